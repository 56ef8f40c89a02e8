"""Trees grown ahead (``max_staleness`` >= 1), kept in a ``trace-rl train`` run folder.

While iteration i updates, iteration i + k's trees grow (``train.phases``); they are part of
the run's state from then on, so a run that stops and goes on reads them back rather than
growing them again on newer weights (which would make other trees than the unbroken run's):

    OUT/ahead/0007/trees.parquet      iteration 7's trees, until iteration 7's folder holds them

A run of K iterations ends with the trees of K + 1 .. K + k here, for a run taken further.

Each is written whole under a staging name and renamed into place. A resumed run takes the
trees of the iterations after its checkpoint from their iteration folders where those were
written (the same trees: a seed and a policy version grow one set of trees), else from here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from trace_core.algo.metrics import measure
from trace_core.algo.tree import RolloutTree
from trace_core.rollout.phase import RolloutResult
from trace_core.store.schema import read_trees, write_trees
from trace_core.train.config import TrainConfig
from trace_core.train.run_folder import iteration_dir, read_latest

AHEAD = "ahead"
TREES = "trees.parquet"


def ahead_dir(out: Path, i: int) -> Path:
    return out / AHEAD / f"{i:04d}"


def keep_ahead(out: Path, i: int, trees: Sequence[RolloutTree]) -> None:
    """Keep iteration ``i``'s trees, grown ahead, in ``out`` (whole or not at all)."""
    final = ahead_dir(out, i)
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_trees(staging / TREES, trees)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)


def drop_ahead(out: Path, i: int) -> None:
    """Iteration ``i`` is written: its folder holds its trees now."""
    shutil.rmtree(ahead_dir(out, i), ignore_errors=True)


def stored_ahead(
    out: Path, done: int, config: TrainConfig, say: Callable[[str], None]
) -> dict[int, RolloutResult]:
    """The trees a run resumed after iteration ``done`` had grown ahead: of the iterations
    ``done + 1`` .. ``done + k`` (k = ``max_staleness``), from their iteration folders (up to
    ``latest``) or ``ahead/``. One that is in neither is grown again, on the weights the run
    resumes with, and said."""
    k = config.max_staleness
    if not k or not done:
        return {}
    latest = read_latest(out) or 0
    found: dict[int, RolloutResult] = {}
    for j in range(done + 1, done + k + 1):
        path = iteration_dir(out, j) / TREES if j <= latest else ahead_dir(out, j) / TREES
        if not path.exists():
            path = ahead_dir(out, j) / TREES
        if not path.exists():
            say(
                f"iteration {j}'s trees, grown ahead, are not in {out}: they are grown again on "
                f"the policy of iteration {done}"
            )
            continue
        trees = read_trees(path)
        found[j] = RolloutResult(trees, measure(trees), seconds=0.0)
    return found


def held_ahead(folder: Path) -> dict[int, RolloutResult]:
    """The trees grown ahead that a folder keeps (a run's, or a pipeline state's
    ``ahead/NNNN``), by iteration."""
    found: dict[int, RolloutResult] = {}
    for path in sorted((folder / AHEAD).glob(f"*/{TREES}")):
        if not path.parent.name.isdigit():
            continue  # a staging folder of a write that did not finish
        trees = read_trees(path)
        found[int(path.parent.name)] = RolloutResult(trees, measure(trees), seconds=0.0)
    return found
