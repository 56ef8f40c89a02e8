"""TensorBoard event files written from a run's log, read back with TensorBoard's own reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_core.train.record import IterationRecord
from trace_core.train.tracking import TENSORBOARD, figures, write_tensorboard


def record(i: int, pass1: float, ratio: float) -> IterationRecord:
    report = {"k": 4, "pass1": {"all": pass1}, "mean_k": {"all": pass1 / 2}, "parse_rate": 1.0}
    rollout = {"prompt_effective_ratio": ratio, "mixed_groups": 3.0} if i else {}
    update = {"loss": -0.1 * i, "kl": 0.0, "logprob_gap": 1e-7, "peak_gib": 1.5} if i else {}
    seconds = {"rollout": 2.0, "update": 1.0} if i else {"eval": 0.5}
    return IterationRecord(
        i, "trace", 10 * i, 10 * i * (i + 1) // 2, rollout, update, report, seconds
    )


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_the_log_reads_back_from_tensorboard_iteration_by_iteration(tmp_path: Path) -> None:
    records = [record(0, 0.5, 0.0), record(1, 0.6, 0.4), record(2, 0.7, 0.5)]
    folder = write_tensorboard(tmp_path, records)
    assert folder == tmp_path / TENSORBOARD
    got = scalars(folder)
    assert got["eval/pass1"] == [(0, 0.5), (1, pytest.approx(0.6)), (2, pytest.approx(0.7))]
    assert got["eval/mean_at_4"][2] == (2, pytest.approx(0.35))
    assert got["rollout/prompt_effective_ratio"] == [(1, pytest.approx(0.4)), (2, 0.5)]
    assert got["rollout/total_tokens"] == [(1, 10.0), (2, 30.0)]
    assert got["update/loss"] == [(1, pytest.approx(-0.1)), (2, pytest.approx(-0.2))]
    assert got["seconds/eval"] == [(0, 0.5)] and got["seconds/update"][1] == (2, 1.0)
    assert "update/peak_gib" not in got  # the machine's memory is not a training figure


def test_a_resumed_run_rewrites_one_event_file_from_its_whole_log(tmp_path: Path) -> None:
    write_tensorboard(tmp_path, [record(0, 0.5, 0.0), record(1, 0.6, 0.4)])
    write_tensorboard(tmp_path, [record(0, 0.5, 0.0), record(1, 0.6, 0.4), record(2, 0.7, 0.5)])
    assert len(list((tmp_path / TENSORBOARD).iterdir())) == 1
    assert [step for step, _ in scalars(tmp_path / TENSORBOARD)["eval/pass1"]] == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == [TENSORBOARD]  # no scratch folder left


def test_a_pipeline_steps_storage_traffic_is_a_figure() -> None:
    step = IterationRecord(2, "trace", 5, 9, {}, {}, None, {}, storage={"s3_bytes": 0.0,
                           "checkpoint_bytes": 1234.0})  # fmt: skip
    assert figures(step)["storage/checkpoint_bytes"] == 1234.0
    assert figures(step)["storage/s3_bytes"] == 0.0


def test_missing_and_non_finite_figures_are_left_out() -> None:
    bare = IterationRecord(1, "grpo", 5, 5, {"units": math.nan}, {}, None, {})
    assert figures(bare) == {
        "rollout/tokens": 5.0,
        "rollout/total_tokens": 5.0,
        "schedule/staleness": 0.0,
    }


def test_the_schedule_is_a_figure() -> None:
    """The update's staleness and the engines' and trainers' idle seconds (``train.phases``)."""
    idle = {"engines": 2.5, "trainers": 0.5}
    ahead = IterationRecord(3, "trace", 5, 9, {}, {}, None, {}, staleness=1, idle=idle)
    got = figures(ahead)
    assert got["schedule/staleness"] == 1.0
    assert (got["schedule/engines_idle_seconds"], got["schedule/trainers_idle_seconds"]) == (
        2.5,
        0.5,
    )
