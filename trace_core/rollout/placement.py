"""Where a tensor-parallel vLLM engine runs: its GPUs reserved together on one node.

    group = tensor_parallel_group(2, threads=4, detached=False)   # 2 GPUs, STRICT_PACK
    EngineWorker.options(scheduling_strategy=in_group(group)).remote(...)

The engine actor sits in bundle 0 without a GPU of its own; vLLM's Ray executor finds the
group it runs in and starts one worker on each bundle's GPU (``ray_worker.executor_backend``).
"""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

UPSTREAM = (
    "ray.util.placement_group.PlacementGroup",
    "ray.util.placement_group.placement_group(bundles, /, strategy, lifetime)",
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
