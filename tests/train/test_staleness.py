"""Bounded staleness (``max_staleness`` k): the trees of iteration i + k grow while iteration i
updates, on iteration i - 1's weights; every tree says which version grew it, every record its
staleness, and a run's trees do not depend on when they were grown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import parity
from typer.testing import CliRunner

from trace_core.algo.tree import RolloutTree
from trace_core.cli import app
from trace_core.policy.update_config import UpdateConfig
from trace_core.rollout.engine_config import EngineConfig
from trace_core.store.schema import read_trees
from trace_core.train.config import STALE_TIS_CAP, TrainConfig
from trace_core.train.loop import train
from trace_core.train.record import IterationRecord
from trace_core.train.run_folder import iteration_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(config: TrainConfig) -> list[IterationRecord]:
    return train(config, suite=parity.ParitySuite())  # type: ignore[arg-type]


def trees_of(out: Path, i: int) -> list[RolloutTree]:
    return read_trees(iteration_dir(out, i) / "trees.parquet")


def weights(out: Path, i: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(iteration_dir(out, i) / "policy" / "model.safetensors"))


def test_trees_grow_ahead_on_older_weights_and_the_same_command_grows_the_same_trees(
    init: Path, tmp_path: Path
) -> None:
    records = run(parity.tiny(init, tmp_path / "a", 4, max_staleness=2))
    # k = 2: iterations 1 and 2 on the start's weights, then each on the weights of i - 3.
    assert [r.staleness for r in records[1:]] == [0, 1, 2, 2]
    assert [trees_of(tmp_path / "a", i)[0].info.policy_version for i in range(1, 5)] == [0, 0, 0, 1]
    # Those grown ahead for 1..4 are in their iterations' folders; 5 and 6 wait for a longer run.
    assert sorted(p.name for p in (tmp_path / "a" / "ahead").iterdir()) == ["0005", "0006"]
    for r in records[1:]:
        assert set(r.idle) == {"engines", "trainers"} and min(r.idle.values()) >= 0
    # trace-rl inspect says how old the trees' weights were, iteration by iteration.
    folder, out = tmp_path / "trees", tmp_path / "summary.json"
    folder.mkdir()
    for i in range(1, 5):
        (folder / f"{i}.parquet").symlink_to(iteration_dir(tmp_path / "a", i) / "trees.parquet")
    shown = CliRunner().invoke(app, ["inspect", "summary", str(folder), "--json", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "staleness 0..2 (trees on older weights: iterations 2, 3, 4)" in " ".join(
        shown.output.split()
    )
    assert json.loads(out.read_text())["staleness"] == {"1": 0, "2": 1, "3": 2, "4": 2}
    again = run(parity.tiny(init, tmp_path / "b", 4, max_staleness=2))
    for i in range(1, 5):
        assert parity.signature(trees_of(tmp_path / "a", i)) == parity.signature(
            trees_of(tmp_path / "b", i)
        )
    assert [r.rollout for r in again] == [r.rollout for r in records]


def test_a_resumed_run_reads_the_trees_it_grew_ahead_and_equals_an_unbroken_one(
    init: Path, tmp_path: Path
) -> None:
    straight = run(parity.tiny(init, tmp_path / "straight", 3, max_staleness=1))
    assert [r.staleness for r in straight[1:]] == [0, 1, 1]
    stopped = run(parity.tiny(init, tmp_path / "resumed", 2, max_staleness=1))
    assert [r.iteration for r in stopped] == [0, 1, 2]
    kept = tmp_path / "resumed" / "ahead" / "0003" / "trees.parquet"  # grown while 2 updated
    assert parity.signature(read_trees(kept)) == parity.signature(
        trees_of(tmp_path / "straight", 3)
    )
    resumed = run(parity.tiny(init, tmp_path / "resumed", 3, max_staleness=1))
    assert [r.rollout for r in resumed] == [r.rollout for r in straight]
    a, b = weights(tmp_path / "straight", 3), weights(tmp_path / "resumed", 3)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_stale_trees_take_the_decoupled_objective() -> None:
    assert TrainConfig().objective().tis_cap == 0  # synchronous: the update as configured
    assert TrainConfig(max_staleness=1).objective().tis_cap == STALE_TIS_CAP
    with pytest.raises(ValueError, match=r"max_staleness 1: .* old_logprobs must be auto"):
        TrainConfig(max_staleness=1, update=UpdateConfig(old_logprobs="engine"))
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        TrainConfig(max_staleness=-1)


@pytest.mark.slow
@pytest.mark.cluster  # Ray in this process
def test_on_actors_the_rollout_ahead_overlaps_the_update_and_grows_the_same_trees(
    init: Path, tmp_path: Path
) -> None:
    """A trainer actor updates while an engine actor grows the trees ahead, on the weights
    before the update: the trees, their versions and every record's staleness are those of the
    run in this process, where rollout and update take turns (and an engine actor's turns,
    which come back in the order they finish, are laid out in the order that made them)."""
    turns = run(parity.tiny(init, tmp_path / "turns", 3, max_staleness=1))
    actors = EngineConfig(workers=1)
    both = run(
        parity.tiny(init, tmp_path / "actors", 3, max_staleness=1, train_workers=1, engine=actors)
    )
    assert [r.staleness for r in both[1:]] == [r.staleness for r in turns[1:]] == [0, 1, 1]
    for i in range(1, 4):
        want = trees_of(tmp_path / "turns", i)
        got = trees_of(tmp_path / "actors", i)
        assert [t.info.policy_version for t in got] == [t.info.policy_version for t in want]
        assert [(t.parent.tolist(), [g.tolist() for g in t.gen_tokens]) for t in got] == [
            (t.parent.tolist(), [g.tolist() for g in t.gen_tokens]) for t in want
        ], i  # node for node
    assert [r.rollout for r in both] == [r.rollout for r in turns]
    assert all("sync" in r.seconds for r in both[1:])  # by broadcast, after each update


@pytest.mark.slow
@pytest.mark.cluster  # Ray in this process
def test_bench_async_times_each_staleness_against_the_synchronous_run(
    init: Path, tmp_path: Path
) -> None:
    out = tmp_path / "async.json"
    command = f"bench async --checkpoint {init} --iterations 2 --staleness 0,1 --budget 4 "
    command += f"--max-tokens 6 --json {out}"
    result = CliRunner().invoke(app, command.split())
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["trainer_actors"], data["engine_actors"], data["threads_per_actor"]) == (1, 1, 1)
    zero, one = data["runs"]["0"], data["runs"]["1"]
    assert (zero["staleness"], one["staleness"]) == ([0, 0], [0, 1])
    assert zero["speedup_vs_0"] == 1.0
    assert one["speedup_vs_0"] == pytest.approx(
        zero["seconds_per_iteration"] / one["seconds_per_iteration"]
    )
    for figures in (zero, one):
        assert 0 <= figures["engine_idle_share"] <= 1 and 0 <= figures["trainer_idle_share"] <= 1
    assert "speedup vs 0" in result.output


class BrokenTaskSuite(parity.ParitySuite):
    """The parity suite, but one training task's env fails on every step, the way a tool
    server that refuses that task's calls does."""

    broken = "calc-train-00033"

    def make_env(self) -> parity.ParityEnv:
        return BrokenEnv()


class BrokenEnv(parity.ParityEnv):
    def reset(self, task):  # type: ignore[no-untyped-def]
        self.broken = task.id == BrokenTaskSuite.broken
        return super().reset(task)

    def step(self, action: str):  # type: ignore[no-untyped-def]
        if self.broken:
            raise ConnectionError(f"tool server refused {BrokenTaskSuite.broken}")
        return super().step(action)


def test_a_prompt_whose_env_fails_is_dropped_said_and_counted_and_the_run_goes_on(
    init: Path, tmp_path: Path
) -> None:
    said: list[str] = []
    config = parity.tiny(init, tmp_path / "run", 2, max_staleness=1)
    records = train(config, suite=BrokenTaskSuite(), progress=said.append)  # type: ignore[arg-type]
    assert [r.iteration for r in records] == [0, 1, 2]
    dropped = [r.rollout["dropped_prompts"] for r in records[1:]]
    assert max(dropped) >= 1  # the broken task is in the pools that drew it
    lines = [line for line in said if "dropped, its env failed: ConnectionError" in line]
    assert lines and all(BrokenTaskSuite.broken in line for line in lines)
    for i in (1, 2):
        assert BrokenTaskSuite.broken not in {t.info.prompt_id for t in trees_of(config.output, i)}
