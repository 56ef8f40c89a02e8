"""``trace-rl compare``'s figures from run records made by hand: the means over seeds with
their t intervals, the per-seed tokens to grpo's final accuracy, the paired differences
against grpo, and the seeds a comparison runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from support.parity import tiny

from trace_core.train.compare import (
    PAIRED,
    CompareConfig,
    CompareResult,
    _tokens_to_reach,
    bounds,
    interval,
    run_compare,
    summarize,
)
from trace_core.train.config import TrainConfig
from trace_core.train.record import IterationRecord, read_log


def record(i: int, total: int, accuracy: float | None, ratio: float = 0.5) -> IterationRecord:
    report = None
    if accuracy is not None:
        report = {"pass1": {"all": accuracy}, "mean_k": {"all": accuracy, "easy": accuracy}}
    rollout = {
        "prompt_effective_ratio": ratio,
        "anchor_effective_ratio": ratio / 2,
        "mixed_per_100_units": 10 * ratio,
    }
    return IterationRecord(i, "x", 0, total, rollout if i else {}, {}, report, {})


def test_tokens_to_reach_interpolates_the_first_crossing() -> None:
    curve = ([0.0, 100.0, 200.0], [0.3, 0.5, 0.6])
    assert _tokens_to_reach(curve, 0.5) == 100.0
    # 0.55 lies halfway between 0.5 (100 tokens) and 0.6 (200 tokens): 150 tokens.
    assert _tokens_to_reach(curve, 0.55) == pytest.approx(150.0)
    assert _tokens_to_reach(curve, 0.2) == 0.0
    assert _tokens_to_reach(curve, 0.61) == float("inf")


def test_interval_by_hand() -> None:
    """(1, 2, 3, 6): mean 3, sample sd sqrt((4 + 1 + 0 + 9) / 3) = 2.1602; t(3) = 3.182:
    half-width 3.182 × 2.1602 / 2 = 3.4369."""
    stats = interval([1.0, 2.0, 3.0, 6.0])
    assert stats["mean"] == 3.0 and stats["n"] == 4.0
    assert stats["std"] == pytest.approx(2.1602, abs=1e-4)
    assert (stats["lo"], stats["hi"]) == pytest.approx((3 - 3.4369, 3 + 3.4369), abs=1e-4)
    one = interval([0.5])
    assert one["mean"] == 0.5 and math.isnan(one["lo"])
    never = interval([0.5, float("inf")])  # one seed never got there
    assert never["mean"] == float("inf") and never["n"] == 1.0 and math.isnan(never["lo"])


def test_summarize_by_hand() -> None:
    # grpo: 0.4 → 0.6 over 300 tokens; trace: reaches 0.6 at 150 tokens and ends at 0.7.
    runs = {
        ("grpo", 0): [record(0, 0, 0.4), record(1, 150, 0.5, 0.4), record(2, 300, 0.6, 0.6)],
        ("trace", 0): [record(0, 0, 0.4), record(1, 150, 0.6, 0.8), record(2, 300, 0.7, 1.0)],
    }
    result = summarize(CompareConfig(strategies=("trace", "grpo"), seeds=1), runs)
    assert result.strategies["trace"]["accuracy"]["mean"] == pytest.approx(0.7)
    assert result.strategies["trace"]["tokens_to_grpo_final"]["mean"] == pytest.approx(150 / 300)
    assert result.strategies["grpo"]["tokens_to_grpo_final"]["mean"] == pytest.approx(1.0)
    assert result.strategies["trace"]["prompt_effective_ratio"]["mean"] == pytest.approx(0.9)
    assert result.strategies["trace"]["anchor_effective_ratio"]["mean"] == pytest.approx(0.45)
    assert result.curves["trace"].tokens == [0.0, 150.0, 300.0]
    assert result.by_difficulty["grpo"] == {"all": 0.6, "easy": 0.6}
    assert set(result.paired) == {"trace"} and set(result.paired["trace"]) == set(PAIRED)
    assert result.paired["trace"]["accuracy"]["mean"] == pytest.approx(0.1)


def test_paired_differences_over_seeds_from_the_first_seed() -> None:
    """Seeds 5, 6, 7. trace − grpo final accuracy per seed: +0.1, +0.2, +0.3 → mean 0.2, sd
    0.1, t(2) = 4.303: half-width 4.303 × 0.1 / √3 = 0.2484. The seeds' own spread (grpo ends
    at 0.3, 0.6, 0.9) is far wider: the paired interval is what tells the two apart."""
    runs = {}
    for n, seed in enumerate((5, 6, 7)):
        grpo_final, trace_final = 0.3 * (n + 1), 0.3 * (n + 1) + 0.1 * (n + 1)
        runs["grpo", seed] = [record(0, 0, 0.1), record(1, 100, grpo_final)]
        runs["trace", seed] = [record(0, 0, 0.1), record(1, 100, trace_final)]
    config = CompareConfig(strategies=("trace", "grpo"), seeds=3, first_seed=5)
    assert config.seed_list == [5, 6, 7]
    result = summarize(config, runs)
    paired = result.paired["trace"]["accuracy"]
    assert paired["mean"] == pytest.approx(0.2)
    assert (paired["lo"], paired["hi"]) == pytest.approx((0.2 - 0.2484, 0.2 + 0.2484), abs=1e-4)
    spread = result.strategies["grpo"]["accuracy"]
    assert spread["hi"] - spread["lo"] > 2.5 * (paired["hi"] - paired["lo"])  # 3×
    assert result.to_json()["config"]["first_seed"] == 5  # type: ignore[index]
    with pytest.raises(ValueError, match="first_seed"):
        CompareConfig(first_seed=-1)


def test_a_result_reads_back_from_its_json() -> None:
    """``CompareResult.from_json`` gives the figures ``to_json`` wrote (the tables in
    docs/results.md are printed from it); a non-finite figure reads back as NaN."""
    import json

    from trace_core.train.compare import CompareResult

    config = CompareConfig(strategies=("grpo", "trace"), seeds=2)
    runs = {
        (name, seed): [record(0, 0, 0.4), record(1, 100, None, 0.3 + 0.1 * seed),
                       record(2, 200, 0.5 if name == "grpo" else 0.45)]
        for name in ("grpo", "trace") for seed in (0, 1)
    }  # fmt: skip
    result = summarize(config, runs)
    back = CompareResult.from_json(json.loads(json.dumps(result.to_json())))
    np.testing.assert_equal(back.per_seed, result.per_seed)  # NaN equals NaN here
    assert back.config == result.config
    assert back.curves == result.curves and back.by_difficulty == result.by_difficulty
    for name, row in result.strategies.items():
        for metric, stats in row.items():
            for key, value in stats.items():
                again = back.strategies[name][metric][key]
                assert again == value or (math.isnan(again) and not math.isfinite(value))
    np.testing.assert_equal(back.paired, result.paired)
    assert math.isnan(back.strategies["trace"]["tokens_to_grpo_final"]["mean"])  # never reached


def test_bounds_read_the_interval_of_either_spelling() -> None:
    assert bounds(interval([1.0, 2.0, 3.0])) == pytest.approx((2 - 2.4843, 2 + 2.4843), abs=1e-4)
    assert bounds({"mean": 1.0, "low": 0.5, "high": 1.5}) == (0.5, 1.5)  # earlier JSON
    assert all(math.isnan(b) for b in bounds({"mean": 1.0, "lo": None, "hi": None}))


def test_staleness_arms_by_hand() -> None:
    """``--staleness 0,1``: every strategy once per k; the k = 0 arm keeps its plain name and
    folder, the k = 1 arm has its own and is paired against the k = 0 one, seed by seed; the
    pairing against grpo stays for the k = 0 arms. trace − trace at k = 0 per seed: −0.1, −0.3
    → mean −0.2, sd 0.1414, t(1) = 12.706: half-width 12.706 × 0.1414 / √2 = 1.2706."""
    config = CompareConfig(strategies=("trace", "grpo"), seeds=2, staleness=(0, 1))
    assert config.arms == ("trace", "trace@k1", "grpo", "grpo@k1")
    assert [config.folder(a) for a in config.arms] == list(config.arms)
    assert config.folder("trace@k0") == "trace" and config.folder("trace@64x6@k2") == (
        "trace@64x6@k2"
    )
    stale = config.run_config("trace@k1", 1, Path("init"))
    assert (stale.max_staleness, stale.output) == (1, Path("build/compare/trace@k1/seed-1"))
    assert config.run_config("trace", 1, Path("init")).max_staleness == 0
    assert config.reference("trace@k1") == "trace" and config.reference("trace") is None
    final = {"trace": (0.6, 0.8), "trace@k1": (0.5, 0.5), "grpo": (0.5, 0.6), "grpo@k1": (0.5, 0.6)}
    runs = {
        (arm, seed): [record(0, 0, 0.4), record(1, 100, final[arm][seed], 0.5)]
        for arm in config.arms
        for seed in (0, 1)
    }
    result = summarize(config, runs)
    assert list(result.strategies) == list(config.arms)
    assert set(result.paired) == {"trace"}  # against grpo: the k = 0 arms only
    assert set(result.paired_staleness) == {"trace@k1", "grpo@k1"}
    paired = result.paired_staleness["trace@k1"]["accuracy"]
    assert paired["mean"] == pytest.approx(-0.2)
    assert (paired["lo"], paired["hi"]) == pytest.approx((-0.2 - 1.2706, -0.2 + 1.2706), abs=1e-4)
    assert result.paired_staleness["grpo@k1"]["accuracy"]["mean"] == pytest.approx(0.0)
    data = result.to_json()
    assert data["config"]["staleness"] == [0, 1]  # type: ignore[index]
    assert CompareResult.from_json(data).paired_staleness == result.paired_staleness
    plain = summarize(
        CompareConfig(strategies=("trace",), seeds=1), {("trace", 0): runs["trace", 0]}
    )
    assert "paired_vs_k0" not in plain.to_json() and "staleness" not in plain.config


def test_staleness_values_are_checked() -> None:
    for bad, says in (((1, 2), "include 0"), ((0, -1), ">= 0"), ((0, 0), "distinct"), ((), "")):
        with pytest.raises(ValueError, match=f"--staleness.*{says}"):
            CompareConfig(staleness=bad)
    with pytest.raises(ValueError, match="leave out --max-staleness"):
        CompareConfig(staleness=(0, 1), run=TrainConfig(max_staleness=1))
    with pytest.raises(ValueError, match="names its own k"):
        CompareConfig(strategies=("trace@k1",), staleness=(0, 1))
    assert CompareConfig(strategies=("trace@64x6@k1",)).arms == ("trace@64x6@k1",)
    for name in ("trace@k1@64x6", "trace@k1@k2", "trace@kk", "trace@"):
        with pytest.raises(ValueError, match="STRATEGY@kK"):
            CompareConfig(strategies=(name,))


@pytest.mark.usefixtures("one_torch_thread")
def test_staleness_arms_run_in_their_own_folders(init: Path, tmp_path: Path) -> None:
    """Two real arms of two tiny iterations on calc (a random policy, ``init``): k = 0 in
    ``trace``, k = 1 in ``trace@k1``; each run's config and records say its k, and the
    paired block is k = 1 − k = 0 of the same seed."""
    run = tiny(init, tmp_path, 2, budget=4, prompts=8, eval_tasks=2, eval_every=2)
    config = CompareConfig(
        "calc", tmp_path, init, ("trace",), seeds=1, run=run, parallel=1, staleness=(0, 1)
    )
    threads = torch.get_num_threads()
    try:
        result = run_compare(config)
    finally:
        torch.set_num_threads(threads)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace", "trace@k1"]
    for arm, k, staleness in (("trace", 0, [0, 0]), ("trace@k1", 1, [0, 1])):
        folder = tmp_path / arm / "seed-0"
        assert json.loads((folder / "config.json").read_text())["max_staleness"] == k
        assert [r.staleness for r in read_log(folder)[1:]] == staleness
    assert set(result.paired_staleness) == {"trace@k1"} and not result.paired
    accuracy = result.per_seed["trace@k1"]["accuracy"][0] - result.per_seed["trace"]["accuracy"][0]
    assert result.paired_staleness["trace@k1"]["accuracy"]["mean"] == pytest.approx(accuracy)


def test_the_staleness_option_refuses_in_one_line(tmp_path: Path) -> None:
    """``compare --staleness``: a bad list ends in one ``error:`` line naming the option, exit
    code 2, before any warm start or run."""
    from typer.testing import CliRunner

    from trace_core.cli import app

    for value, says in (("1,2", "include 0"), ("0,x", "whole numbers"), ("0,-1", ">= 0")):
        command = ["compare", "--strategies", "trace", "--staleness", value]
        done = CliRunner().invoke(app, [*command, "--output", str(tmp_path / "out")])
        errors = [line for line in done.output.splitlines() if line.startswith("error:")]
        assert done.exit_code == 2 and len(errors) == 1, done.output
        assert errors[0].startswith("error: --staleness") and says in errors[0], errors
    assert not (tmp_path / "out").exists()
