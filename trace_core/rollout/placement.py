"""Where a tensor-parallel vLLM engine runs: its GPUs reserved together on one node; and a
run's trainers: their devices reserved as one group, all or nothing.

    group = tensor_parallel_group(2, threads=4, detached=False)   # 2 GPUs, STRICT_PACK
    EngineWorker.options(scheduling_strategy=in_group(group)).remote(...)
    group = reserve([{"CPU": 1.0, "GPU": 1.0}] * 4, "run-trainer", True, 1800, "trainers")
    TrainerRank.options(scheduling_strategy=in_bundle(group, rank)).remote(...)

The engine actor sits in bundle 0 without a GPU of its own; vLLM's Ray executor finds the
group it runs in and starts one worker on each bundle's GPU (``ray_worker.executor_backend``).

A group is reserved whole or not at all: two runs on one cluster that each took part of its
GPUs would wait for each other forever. ``reserve`` waits for the whole group; when it does
not fit in time, the group is removed (nothing of it stays reserved) and the error names the
shortfall: what was asked against what the cluster has free and in all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

UPSTREAM = (
    "ray.util.placement_group.PlacementGroup",
    "ray.util.placement_group.PlacementGroup(id, /)",
    "ray.util.placement_group.PlacementGroup.wait(timeout_seconds, /)",
    "ray.util.placement_group.placement_group(bundles, /, strategy, name, lifetime)",
    "ray.util.placement_group.placement_group_table()",
    "ray.util.placement_group.remove_placement_group(placement_group, /)",
    "ray.PlacementGroupID.from_hex(hex_id, /)",
    "ray.available_resources()",
    "ray.cluster_resources()",
    "ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(placement_group, "
    "placement_group_bundle_index, placement_group_capture_child_tasks)",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""


def tensor_parallel_group(gpus: int, threads: int, detached: bool) -> PlacementGroup:
    """The placement group of one tensor-parallel vLLM engine: ``gpus`` bundles of one GPU
    each, packed on one node (STRICT_PACK). vLLM finds the group it runs in and puts one of its
    Ray workers (no CPU, one GPU) on each bundle; it refuses bundles of more than one GPU. The
    engine actor takes bundle 0's ``threads`` CPUs and no GPU. ``detached``: outlives this
    job, with a kept actor."""
    bundles = [{"GPU": 1.0, **({"CPU": float(threads)} if i == 0 else {})} for i in range(gpus)]
    return placement_group(
        bundles, strategy="STRICT_PACK", lifetime="detached" if detached else None
    )


def in_group(group: PlacementGroup) -> PlacementGroupSchedulingStrategy:
    """Schedule an engine actor on bundle 0 of ``group``; what it starts (vLLM's workers)
    lands in the group too."""
    return PlacementGroupSchedulingStrategy(
        placement_group=group,
        placement_group_bundle_index=0,
        placement_group_capture_child_tasks=True,
    )


class PlacementError(RuntimeError):
    """A group that did not fit in time: one line naming the shortfall (``reserve``)."""


def reserve(
    bundles: Sequence[Mapping[str, float]],
    name: str,
    detached: bool,
    timeout_s: float,
    what: str,
    setting: str = "ready_timeout_s",
) -> PlacementGroup:
    """``bundles`` reserved as one placement group ``name`` (PACK: as few nodes as fit, more
    when they must), waited for up to ``timeout_s``; ``detached``: it outlives this driver.
    On timeout the group is removed and ``PlacementError`` says what ``what`` (the trainers of
    a run, say) asked for and what the cluster had (``setting``: the timeout's name)."""
    group = placement_group(
        [dict(b) for b in bundles],
        strategy="PACK",
        name=name,
        lifetime="detached" if detached else None,
    )
    if group.wait(timeout_s):
        return group
    remove_placement_group(group)  # all or nothing: no part of it stays reserved
    raise PlacementError(shortfall(bundles, what, timeout_s, setting))


def shortfall(
    bundles: Sequence[Mapping[str, float]], what: str, timeout_s: float, setting: str
) -> str:
    """One line: the group asked for, against the cluster's free and total resources of the
    kinds it asks for."""
    kinds = sorted({k for b in bundles for k in b})
    asked = {k: sum(b.get(k, 0.0) for b in bundles) for k in kinds}
    free, total = ray.available_resources(), ray.cluster_resources()

    def show(amounts: Mapping[str, float]) -> str:
        return ", ".join(f"{amounts.get(k, 0.0):g} {k}" for k in kinds)

    shapes = sorted({", ".join(f"{v:g} {k}" for k, v in sorted(b.items())) for b in bundles})
    return (
        f"{what}: {len(bundles)} bundle(s) of {' / '.join(shapes)} ({show(asked)} in all), "
        f"reserved together or not at all, did not fit within {timeout_s:g} s ({setting}): "
        f"the cluster has {show(free)} free of {show(total)}; another run may hold the rest: "
        f"wait for it to end, or give the cluster room (or ask for less)"
    )


def named_groups(name: str) -> list[PlacementGroup]:
    """The placement groups called ``name`` that are not removed (any namespace's: a step's
    driver names them in its own)."""
    return [
        PlacementGroup(ray.PlacementGroupID.from_hex(group_id))
        for group_id, entry in placement_group_table().items()
        if entry.get("name") == name and entry.get("state") != "REMOVED"
    ]


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Schedule an actor on bundle ``index`` of ``group`` (a trainer rank on its own)."""
    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )
