"""Where a run's devices are reserved: its trainers and engines as ONE placement group, all or
nothing; a tensor-parallel vLLM engine's GPUs in one bundle of it, on one node.

    placement = reserve_run(RunShape(trainers=4, trainer_gpus=True, engines=2, engine_gpus=2),
                            "run-0a1b2c3d-run", detached=True, timeout_s=1800, what="...")
    TrainerRank.options(scheduling_strategy=placement.trainer()).remote(...)   # every rank
    EngineWorker.options(num_gpus=2, scheduling_strategy=placement.engine(i)).remote(...)

**What Ray 2.60 guarantees, and what the run's group is built on.** A placement group is
reserved whole or not at all: its bundles are committed together (two-phase, by the GCS), and a
group that does not fit holds nothing while it waits. Two runs on one cluster that each took
part of its GPUs would wait for each other forever; with one group a run, the second simply
waits (or, past its timeout, is removed and says so). A *bundle* is never split across nodes.
PACK places bundles on as few nodes as it can, best effort; STRICT_PACK puts the whole group
on one node; neither can say "these bundles together, those anywhere", and
``bundle_label_selector`` and ``topology_strategy`` (2.60's) select nodes by label, which
names no node that a Pending pod has not brought up yet. So the run's group (``RunShape``) is:

- bundle 0: every trainer rank's devices in ONE bundle (``trainers`` CPUs, and as many GPUs
  with ``trainer_gpus``): the ranks land on one node, guaranteed (one pod holds a node's GPUs:
  NCCL between them over NVLink and shared memory); each rank is an actor of one CPU (and one
  GPU) scheduled into that bundle, and Ray gives each its own GPU of it. Trainers beyond a
  node's GPUs never fit: ``TrainConfig`` refuses them before any work (``gpus_per_node``).
- bundles 1..E: one per engine actor (its threads, and its GPUs): one node each; PACK puts them
  beside the trainers first, then on further nodes, best effort (``RunPlacement.nodes`` says
  where they landed).

A tensor-parallel vLLM engine is one engine actor holding all its ranks' GPUs
(``EngineConfig.engine_gpus``), so its bundle, like any, lies on one node, and it is reserved
with the trainers and the other engines. vLLM runs its ranks as processes of that actor (its
multiprocessing executor, ``ray_worker.executor_backend``): each sees the actor's GPUs and
takes one. vLLM's Ray executor would instead start a worker per GPU bundle of the group it
runs in, refusing bundles of more than one GPU (the trainers' is one), so it cannot share a
run's group.

``reserve`` and ``reserve_run`` wait for the whole group, saying every ``every_s`` what is still
pending (which bundles, how many GPUs, for how long: a cluster that scales up from zero takes
minutes); when it does not fit in time, the group is removed (nothing of it stays reserved) and
the error names the shortfall: what was asked against what the cluster has free and in all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trace_core.rollout.engine_config import EngineConfig

UPSTREAM = (
    "ray.util.placement_group.PlacementGroup",
    "ray.util.placement_group.PlacementGroup(id, /)",
    "ray.util.placement_group.PlacementGroup.wait(timeout_seconds, /)",
    "ray.util.placement_group.PlacementGroup.bundle_specs",
    "ray.util.placement_group.placement_group(bundles, /, strategy, name, lifetime)",
    "ray.util.placement_group.placement_group_table(placement_group, /)",
    "ray.util.placement_group.remove_placement_group(placement_group, /)",
    "ray.PlacementGroupID.from_hex(hex_id, /)",
    "ray.available_resources()",
    "ray.cluster_resources()",
    "ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(placement_group, "
    "placement_group_bundle_index)",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""


PROGRESS_EVERY_S = 60.0
"""How often a wait for a placement group says what is still pending."""


class PlacementError(RuntimeError):
    """A group that did not fit in time: one line naming the shortfall (``reserve``)."""


def reserve(
    bundles: Sequence[Mapping[str, float]],
    name: str,
    detached: bool,
    timeout_s: float,
    what: str,
    setting: str = "ready_timeout_s",
    say: Callable[[str], None] | None = None,
    every_s: float = PROGRESS_EVERY_S,
    described: str = "",
    kinds: Sequence[str] = (),
) -> PlacementGroup:
    """``bundles`` reserved as one placement group ``name`` (PACK: as few nodes as fit, more
    when they must), waited for up to ``timeout_s``; ``detached``: it outlives this driver.
    While it waits, ``say`` gets a line every ``every_s`` seconds saying what is pending
    (``pending_line``; ``kinds``: what each bundle holds). On timeout the group is removed and
    ``PlacementError`` says what ``what`` (the trainers of a run, say) asked for
    (``described``: in words) and what the cluster had (``setting``: the timeout's name)."""
    group = placement_group(
        [dict(b) for b in bundles],
        strategy="PACK",
        name=name,
        lifetime="detached" if detached else None,
    )
    if wait_placed(group, timeout_s, what, setting, say, every_s, kinds):
        return group
    remove_placement_group(group)  # all or nothing: no part of it stays reserved
    raise PlacementError(shortfall(bundles, what, timeout_s, setting, described))


def wait_placed(
    group: PlacementGroup,
    timeout_s: float,
    what: str,
    setting: str = "ready_timeout_s",
    say: Callable[[str], None] | None = None,
    every_s: float = PROGRESS_EVERY_S,
    kinds: Sequence[str] = (),
) -> bool:
    """Whether ``group`` is placed within ``timeout_s``; meanwhile a ``pending_line`` to
    ``say`` every ``every_s`` seconds. Ray waits in whole seconds (``PlacementGroup.wait``
    drops a fraction: 0.5 returns at once), so each wait is one second at least."""
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        step = min(every_s, left) if say is not None else left
        if group.wait(max(1, math.ceil(step))):
            return True
        waited = time.monotonic() - start
        if waited >= timeout_s:
            return False
        if say is not None:
            say(pending_line(group, what, waited, timeout_s, setting, kinds))


def pending_line(
    group: PlacementGroup,
    what: str,
    waited_s: float,
    timeout_s: float,
    setting: str,
    kinds: Sequence[str] = (),
) -> str:
    """One line: which bundles of ``group`` are not placed yet (by what they hold, ``kinds``,
    and index), the GPUs and CPUs they ask for, the cluster's free ones, Ray's scheduling
    state, and how long it has waited of how long."""
    entry = placement_group_table(group) or {}
    bundles = {int(i): b for i, b in (entry.get("bundles") or {}).items()}
    nodes = {int(i): n for i, n in (entry.get("bundles_to_node_id") or {}).items()}
    waiting = [i for i in sorted(bundles) if not _placed(nodes.get(i))]
    asked = {k: sum(bundles[i].get(k, 0.0) for i in waiting) for k in ("GPU", "CPU")}
    by_kind: dict[str, list[int]] = {}
    for i in waiting:
        by_kind.setdefault(kinds[i] if i < len(kinds) else "bundles", []).append(i)
    listed = ", ".join(f"{kind} {_listed(ix)}" for kind, ix in by_kind.items()) or "none"
    free = ray.available_resources()
    state = entry.get("state", "PENDING")
    why = (entry.get("stats") or {}).get("scheduling_state", "")
    return (
        f"{what}: waiting {_duration(waited_s)} of {_duration(timeout_s)} ({setting}) for "
        f"{len(waiting)} of {len(bundles)} bundle(s) ({listed}): "
        f"{asked['GPU']:g} GPU, {asked['CPU']:g} CPU, reserved together; the cluster has "
        f"{free.get('GPU', 0.0):g} GPU, {free.get('CPU', 0.0):g} CPU free; group "
        f"{state}{f' ({why})' if why else ''}: pods may be Pending while nodes come up"
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _placed(node: str | None) -> bool:
    """Whether a ``bundles_to_node_id`` value names a node (unplaced: empty or nil)."""
    return bool(node) and set(str(node)) != {"f"}


def _listed(indices: Sequence[int]) -> str:
    """Bundle indices as ranges: ``0-3, 5``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def shortfall(
    bundles: Sequence[Mapping[str, float]],
    what: str,
    timeout_s: float,
    setting: str,
    described: str = "",
) -> str:
    """One line: the group asked for (``described``, or its bundles' shapes), against the
    cluster's free and total resources of the kinds it asks for."""
    kinds = sorted({k for b in bundles for k in b})
    asked = {k: sum(b.get(k, 0.0) for b in bundles) for k in kinds}
    free, total = ray.available_resources(), ray.cluster_resources()

    def show(amounts: Mapping[str, float]) -> str:
        return ", ".join(f"{amounts.get(k, 0.0):g} {k}" for k in kinds)

    shapes = sorted({", ".join(f"{v:g} {k}" for k, v in sorted(b.items())) for b in bundles})
    asked_line = described or f"{len(bundles)} bundle(s) of {' / '.join(shapes)}"
    return (
        f"{what}: {asked_line} ({show(asked)} in all), "
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


# --- the run's group: trainers and engines, all or nothing -----------------------------------
@dataclass(frozen=True)
class RunShape:
    """What a run reserves as one group (module docstring): its trainers' devices as bundle 0,
    then one bundle per engine actor. ``trainers`` 0: engines only; ``engines`` 0: trainers
    only. Without GPUs (a CPU-only run) the bundles hold CPUs alone."""

    trainers: int = 0
    trainer_gpus: bool = False
    """Each trainer rank takes one GPU (else one CPU only)."""
    engines: int = 0
    engine_threads: int = 1
    """CPUs of each engine actor (``threads_per_worker``)."""
    engine_gpus: float = 0.0
    """GPUs of each engine actor (``gpus_per_worker``; 0: CPU engines)."""

    def __post_init__(self) -> None:
        if self.trainers < 0 or self.engines < 0 or self.trainers + self.engines < 1:
            raise ValueError(
                f"a run's group holds trainers and/or engines, got {self.trainers} trainers and "
                f"{self.engines} engines"
            )
        if self.engine_threads < 1 or self.engine_gpus < 0:
            raise ValueError("engine_threads must be >= 1 and engine_gpus >= 0")

    @property
    def trainer_bundle(self) -> int | None:
        """The index of the trainers' bundle (None: no trainers)."""
        return 0 if self.trainers else None

    def engine_bundle(self, engine: int) -> int:
        """The index of engine actor ``engine``'s bundle."""
        if not 0 <= engine < self.engines:
            raise ValueError(f"engine {engine}: the run's group holds {self.engines} engines")
        return engine + (1 if self.trainers else 0)

    def bundles(self) -> list[dict[str, float]]:
        trainers = {"CPU": float(self.trainers)}
        if self.trainer_gpus:
            trainers["GPU"] = float(self.trainers)
        engine = {"CPU": float(self.engine_threads)}
        if self.engine_gpus:
            engine["GPU"] = float(self.engine_gpus)
        return ([trainers] if self.trainers else []) + [dict(engine) for _ in range(self.engines)]

    def kinds(self) -> list[str]:
        """What each bundle holds: ``trainers``, then ``engines``."""
        return ["trainers"] * (1 if self.trainers else 0) + ["engines"] * self.engines

    def describe(self) -> str:
        """The bundles in words: ``trainers: 1 bundle of 4 CPU, 4 GPU (one node); engines: 12
        bundles of 1 CPU, 1 GPU``."""
        bundles = self.bundles()
        parts = []
        if self.trainers:
            parts.append(f"trainers: 1 bundle of {_amounts(bundles[0])} (one node)")
        if self.engines:
            plural = "s" if self.engines > 1 else ""
            parts.append(f"engines: {self.engines} bundle{plural} of {_amounts(bundles[-1])}")
        return "; ".join(parts)


def _amounts(bundle: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(bundle.items()))


@dataclass(frozen=True)
class RunPlacement:
    """A run's reserved group and where its trainers and engines go in it."""

    group: PlacementGroup
    shape: RunShape
    name: str

    def trainer(self) -> PlacementGroupSchedulingStrategy:
        """A trainer rank's place: the trainers' bundle (every rank in the same one)."""
        index = self.shape.trainer_bundle
        if index is None:
            raise ValueError(f"the run's group {self.name} holds no trainers")
        return in_bundle(self.group, index)

    def engine(self, engine: int) -> PlacementGroupSchedulingStrategy:
        """Engine actor ``engine``'s place: its own bundle."""
        return in_bundle(self.group, self.shape.engine_bundle(engine))

    def nodes(self) -> dict[int, str]:
        """Bundle index → the node it was placed on (hex node id), once placed."""
        entry = placement_group_table(self.group) or {}
        placed = (entry.get("bundles_to_node_id") or {}).items()
        return {int(i): str(n) for i, n in placed if _placed(n)}

    def remove(self) -> None:
        """Free the group's devices; every actor in it stops with it."""
        remove_placement_group(self.group)


def run_group_name(session: str) -> str:
    """The name of the placement group of the run ``session`` (its actors: ``<session>-<i>``,
    ``<session>-trainer-<rank>``)."""
    return f"{session}-run"


def reserve_run(
    shape: RunShape,
    name: str,
    detached: bool,
    timeout_s: float,
    what: str,
    setting: str = "ready_timeout_s",
    say: Callable[[str], None] | None = None,
    every_s: float = PROGRESS_EVERY_S,
) -> RunPlacement:
    """The run's group (``shape``) reserved whole, as ``reserve`` does (PACK, waited for up to
    ``timeout_s``, progress to ``say``, removed on timeout with the shortfall in one line)."""
    group = reserve(
        shape.bundles(),
        name,
        detached=detached,
        timeout_s=timeout_s,
        what=what,
        setting=setting,
        say=say,
        every_s=every_s,
        described=shape.describe(),
        kinds=shape.kinds(),
    )
    return RunPlacement(group, shape, name)


def find_run(shape: RunShape, name: str) -> RunPlacement | None:
    """The run's group ``name`` reserved by an earlier step, if it is not removed (it may wait
    for a lost node's bundles: ``wait_placed``); one of other bundles than ``shape``'s is
    refused (a run's shape is fixed for the run)."""
    for group in named_groups(name):
        if group.bundle_specs != shape.bundles():
            raise ValueError(
                f"the run's placement group {name} holds {group.bundle_specs}, not this step's "
                f"{shape.bundles()} ({shape.describe()}): release the run first"
            )
        return RunPlacement(group, shape, name)
    return None


def run_shape(trainers: int, trainer_gpus: bool, engine: EngineConfig) -> RunShape:
    """A run's group: ``trainers`` ranks (each one GPU with ``trainer_gpus``) and ``engine``'s
    Ray engine actors, each with its threads and ``engine_gpus`` (a tensor-parallel engine's:
    all its ranks')."""
    return RunShape(
        trainers=trainers,
        trainer_gpus=trainer_gpus,
        engines=engine.workers,
        engine_threads=engine.threads_per_worker,
        engine_gpus=engine.engine_gpus if engine.workers else 0.0,
    )
