"""``trace-rl compare``'s figures from run records made by hand: the means over seeds with
their t intervals, the per-seed tokens to grpo's final accuracy, the paired differences
against grpo, and the seeds a comparison runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_core.train.compare import (
    PAIRED,
    CompareConfig,
    _tokens_to_reach,
    bounds,
    interval,
    summarize,
)
from trace_core.train.record import IterationRecord


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
