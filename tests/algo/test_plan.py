"""Strategies: every name plans an equal budget, by the rule the table in trace_core/algo/plan.py
gives it."""

from __future__ import annotations

import numpy as np
import pytest

from trace_core.algo.plan import STRATEGIES, Budget, plan, split_groups, strategy


def test_every_design_strategy_exists() -> None:
    assert set(STRATEGIES) == {
        "grpo",
        "pcl",
        "treepo",
        "trace",
        "trace-root",
        "trace-prefix",
        "trace-auto",
        "oracle",
    }
    with pytest.raises(ValueError, match="unknown strategy 'ppo'; choose one of grpo, pcl"):
        strategy("ppo")


def test_budget_units() -> None:
    # M = 1024 roots with N = 2 continuations each: 1024 · (1 + 2/2) = 2048 units
    budget = Budget(roots=1024, continuations=2)
    assert budget.units == 2048 and budget.flat_roots == 2048
    # M = 5, N = 1: 5 · 1.5 = 7.5 units; a flat strategy can buy 7 whole roots
    assert Budget(5, 1).flat_roots == 7


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"roots": 1, "continuations": 2}, "roots must be at least 2"),
        ({"roots": 8, "continuations": -1}, "continuations must be >= 0"),
        ({"roots": 8, "continuations": 2, "group": 1}, "group must be at least 2"),
    ],
)
def test_budget_rejects_bad_values(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_spends_the_same_units(name: str) -> None:
    rng = np.random.default_rng(0)
    scores = rng.beta(0.4, 0.4, size=512)
    budget = Budget(roots=256, continuations=2, group=8)
    root_plan = plan(name, scores, budget, rng)
    assert root_plan.units == budget.units == 512
    assert not (root_plan.counts == 1).any()
    if strategy(name).flat:
        assert root_plan.counts.sum() == 512 and root_plan.continuations.sum() == 0
    elif strategy(name).auto_shape:  # 256 × 2 or 128 × 6: the same 512 units
        roots = int(root_plan.counts.sum())
        assert roots in (256, 128)
        per_root = 2 if roots == 256 else 6
        np.testing.assert_array_equal(root_plan.continuations, per_root * root_plan.counts)
    else:
        assert root_plan.counts.sum() == 256
        np.testing.assert_array_equal(root_plan.continuations, 2 * root_plan.counts)


def test_fixed_group_strategies() -> None:
    rng = np.random.default_rng(1)
    scores = np.array([0.05, 0.5, 0.95, 0.45, 0.7, 0.0])
    budget = Budget(roots=4, continuations=2, group=4)  # 8 units: two flat groups of 4
    pcl = plan("pcl", scores, budget, rng)
    # |v − 0.5| = [0.45, 0, 0.45, 0.05, 0.2, 0.5]: nearest are prompts 1 and 3
    assert pcl.counts.tolist() == [0, 4, 0, 4, 0, 0]
    grpo = plan("grpo", scores, budget, rng)
    assert sorted(grpo.counts.tolist()) == [0, 0, 0, 0, 4, 4]
    treepo = plan("treepo", scores, budget, rng)
    assert sorted(treepo.counts.tolist()) == [0, 0, 0, 0, 0, 4]


def test_split_groups() -> None:
    assert split_groups(16, 10, 8).tolist() == [8, 8]
    assert split_groups(19, 10, 8).tolist() == [8, 8, 3]  # leftover 3 forms a group
    assert split_groups(17, 10, 8).tolist() == [9, 8]  # leftover 1 joins the first
    assert split_groups(20, 2, 8).tolist() == [10, 10]  # too few prompts: groups grow
    with pytest.raises(ValueError, match="groups of >= 2"):
        split_groups(1, 3, 8)


def test_expand_rules() -> None:
    rng = np.random.default_rng(2)
    budget = Budget(roots=2, continuations=2, group=2)
    rewards, values = [0, 0, 1], [0.9, 0.5, 0.99]
    trace = plan("trace", [0.5, 0.0], budget, rng)
    assert trace.counts.tolist() == [2, 0] and trace.continuations.tolist() == [4, 0]
    # unit gains q^(k−1)(1−q), q = P(repeat r): prefix 0 (q = 0.1): 0.9, 0.09, ...;
    # prefix 1 (q = 0.5): 0.5, 0.25, 0.125, ...; prefix 2 (q = 0.99): 0.01, ...
    # the four largest: 0.9, 0.5, 0.25, 0.125 → k = [1, 3, 0]
    assert trace.expand(0, rewards, values, rng).tolist() == [1, 3, 0]
    assert trace.expand(1, rewards, values, rng).tolist() == [0, 0, 0]  # skipped prompt
    treepo = plan("treepo", [0.5, 0.5], budget, rng)
    prompt = int(np.flatnonzero(treepo.counts)[0])
    assert treepo.expand(prompt, rewards, values, rng).sum() == 4
    grpo = plan("grpo", [0.5, 0.5], budget, rng)
    assert grpo.expand(0, rewards, values, rng).tolist() == [0, 0, 0]
