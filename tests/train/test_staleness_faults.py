"""Faults without hangs at ``max_staleness`` 1, on a loopback Ray head: engine actors and a
trainer actor killed while the trees ahead grow during the updates, and a run stopped mid-way
and run again. Every run is guarded by a time limit (a hang fails in one line naming the run),
and each ends as the unbroken run does: the same records, the same trees."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray
from support import parity

from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Step
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.ray_pool import EngineStartError, RayEnginePool
from trace_core.store.schema import read_trees
from trace_core.train import loop
from trace_core.train.ahead import ahead_dir
from trace_core.train.config import TrainConfig
from trace_core.train.loop import train
from trace_core.train.record import IterationRecord
from trace_core.train.run_folder import iteration_dir
from trace_core.train.trainer_group import TRAINER_NAMESPACE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,  # a loopback Ray head, shared by the module
    pytest.mark.usefixtures("one_torch_thread", "head"),
]

ITERATIONS = 3
LIMIT_S = 120.0
"""No run of these takes half of it; one that does is a hang."""
T = TypeVar("T")
Straight = tuple[list[IterationRecord], Path]
"""The unbroken run's records and folder."""


@pytest.fixture(scope="module")
def head(start_ray_head: Callable[..., Any]) -> Iterator[str]:
    """One Ray head for the module: every run's trainer and engine actors start on it."""
    with start_ray_head() as started:
        ray.init(address=started.address, logging_level=logging.WARNING)
        try:
            yield started.address
        finally:
            ray.shutdown()


def actors(init: Path, out: Path) -> TrainConfig:
    """The tiny run at k = 1 on one trainer actor and one engine actor."""
    engine = EngineConfig(workers=1)
    return parity.tiny(init, out, ITERATIONS, max_staleness=1, train_workers=1, engine=engine)


def within(what: str, call: Callable[[], T]) -> T:
    """``call()``, which must end (return or raise) within ``LIMIT_S``."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    assert not thread.is_alive(), f"{what} hung: no end within {LIMIT_S:g} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run(
    config: TrainConfig,
    say: Callable[[str], None] | None = None,
    suite: parity.ParitySuite | None = None,
) -> list[IterationRecord]:
    return within(
        f"the run in {config.output}",
        lambda: train(config, say, suite or parity.ParitySuite()),
    )


@pytest.fixture(scope="module")
def straight(init: Path, tmp_path_factory: pytest.TempPathFactory) -> Straight:
    """The unbroken run every faulted one is compared with: in this process, a tenth of the
    time of one on actors, which grows the same trees and records (``test_staleness``'s
    ``test_on_actors_the_rollout_ahead_overlaps_the_update_and_grows_the_same_trees``)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return run(parity.tiny(init, out, ITERATIONS, max_staleness=1)), out


def trees_of(out: Path, i: int) -> list[RolloutTree]:
    return read_trees(iteration_dir(out, i) / "trees.parquet")


def same_run(out: Path, records: list[IterationRecord], straight: Straight) -> None:
    """``out`` and its records are the unbroken run's: every iteration's rollout and trees,
    and the trees it grew ahead for the iteration after its last."""
    want, want_out = straight
    assert [r.iteration for r in records] == list(range(ITERATIONS + 1))
    assert [r.rollout for r in records] == [r.rollout for r in want]
    assert [r.staleness for r in records] == [r.staleness for r in want]
    for i in range(1, ITERATIONS + 1):
        assert parity.signature(trees_of(out, i)) == parity.signature(trees_of(want_out, i)), i
    assert parity.signature(ahead(out)) == parity.signature(ahead(want_out))


def ahead(out: Path) -> list[RolloutTree]:
    return read_trees(ahead_dir(out, ITERATIONS + 1) / "trees.parquet")


class Hooked(parity.ParitySuite):
    """The parity suite whose envs, in this process, run a fault on the first step of a turn
    after the line that arms it is said (``say``): at the first turn of the trees that grow
    while the iteration after that line updates."""

    def __init__(self, faults: dict[str, Callable[[], None]]) -> None:
        super().__init__()
        self.faults = faults
        self.armed: list[Callable[[], None]] = []
        self.said: list[str] = []

    def say(self, message: str) -> None:
        self.said.append(message)
        self.armed += [fault for line, fault in self.faults.items() if message.startswith(line)]

    def make_env(self) -> parity.ParityEnv:
        suite = self

        class Env(parity.ParityEnv):
            def step(self, action: str) -> Step:
                while suite.armed:
                    suite.armed.pop(0)()
                return super().step(action)

        return Env()


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[RayEnginePool]:
    """Every engine pool a run opens, as it opens it (to kill its actors' processes)."""
    opened: list[RayEnginePool] = []
    start = RayEnginePool.__init__

    def track(self: RayEnginePool, *args: Any, **kwargs: Any) -> None:
        start(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(RayEnginePool, "__init__", track)
    return opened


def test_actors_killed_during_the_updates_come_back_and_the_run_ends_as_an_unbroken_one(
    init: Path,
    tmp_path: Path,
    straight: Straight,
    pools: list[RayEnginePool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three faults in one run (each costs an actor's start, not a run's):

    1. While iteration 1 updates, once iteration 2's trees are grown ahead, the engine actor
       dies. Ray restarts it on the starting policy; the wait for it is bounded (past
       ``ready_timeout_s``, one line names it), and the sync after the update rebuilds its
       group and brings it the new weights.
    2. While iteration 2 updates, at the first turn of iteration 3's trees, the engine actor
       dies while it serves iteration 1's synced weights: the engines take them from iteration
       1's checkpoint and the trees grow again, said in one line.
    3. While iteration 3 updates, at the first turn of iteration 4's trees, the trainer actor
       dies: the update (or the sync after it, whichever it broke) is done again on trainers
       rebuilt from iteration 2's checkpoint, said in one line.

    The records and every tree, those grown ahead for iteration 4 too, are the unbroken run's."""
    out = tmp_path / "killed"
    killed: list[int] = []

    def kill_engine() -> None:
        killed.append(pools[-1].kill_worker_process(0, signal.SIGKILL))

    def kill_trainer() -> None:
        actor = ray.get_actor(f"{out.name}-trainer-0", namespace=TRAINER_NAMESPACE)
        ray.kill(actor, no_restart=True)
        killed.append(0)

    kept = loop.keep_ahead

    def keep(folder: Path, j: int, trees: Sequence[RolloutTree]) -> None:
        kept(folder, j, trees)
        if j != 2:
            return
        kill_engine()
        pool = pools[-1]
        patient, pool.ready_timeout_s = pool.ready_timeout_s, 0.05  # it takes seconds
        with pytest.raises(EngineStartError) as late:
            pool.worker_pids()
        pool.ready_timeout_s = patient
        assert str(late.value).startswith(
            "engine workers [0] did not answer within 0.05 s (ready_timeout_s) for their process"
        )

    monkeypatch.setattr(loop, "keep_ahead", keep)
    suite = Hooked({"iteration 1/3:": kill_engine, "iteration 2/3:": kill_trainer})
    records = run(actors(init, out), suite.say, suite)
    assert len(killed) == 3 and len(set(killed)) == 3, killed
    regrown = "iteration 3: an engine actor was restarted during its rollout: the engines load "
    regrown += f"iteration 1's weights from {iteration_dir(out, 1)}/policy and the trees grow again"
    rebuilt = "a trainer actor died: the trainers start again from iteration 2's checkpoint "
    rebuilt += f"({iteration_dir(out, 2)})"
    assert [m for m in suite.said if "died" in m or "restarted" in m] == [regrown, rebuilt]
    same_run(out, records, straight)


def test_a_run_stopped_mid_way_and_run_again_equals_an_unbroken_one(
    init: Path, tmp_path: Path, straight: Straight, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process is lost while iteration 2 updates, once iteration 3's trees are kept: the same
    command resumes after iteration 1 from its checkpoint, reads iteration 2's trees from
    ``ahead/``, grows iteration 3's again (the same trees) and ends as the unbroken run."""
    out = tmp_path / "stopped"

    class Lost(Exception):
        pass

    kept = loop.keep_ahead

    def keep(folder: Path, j: int, trees: Sequence[RolloutTree]) -> None:
        kept(folder, j, trees)
        if j == 3:
            raise Lost

    with monkeypatch.context() as patched:
        patched.setattr(loop, "keep_ahead", keep)
        with pytest.raises(Lost):
            run(actors(init, out))
    assert sorted(p.name for p in (out / "ahead").iterdir()) == ["0002", "0003"]
    said: list[str] = []
    records = run(actors(init, out), said.append)
    assert any(m.startswith("resuming after iteration 1 ") for m in said), said
    same_run(out, records, straight)
    assert sorted(p.name for p in (out / "ahead").iterdir()) == ["0004"]
