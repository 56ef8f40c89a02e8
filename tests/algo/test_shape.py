"""trace-auto's shape: the candidates spend the iteration's units exactly, the choice follows
the measured continuation worth ω, and ω is measured from the trees as the docstring says."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_core.algo.allocate import allocate_roots, contrast
from trace_core.algo.plan import Budget, plan
from trace_core.algo.shape import (
    PRIOR_WORTH,
    candidate_shapes,
    choose_shape,
    continuation_worth,
    episode_rewards,
    shape_value,
)
from trace_core.algo.tree import ROOT, RolloutTree, TreeBuilder, TreeInfo


def test_the_candidates_spend_the_units_exactly() -> None:
    assert candidate_shapes(256, 2) == [(128, 2), (64, 6)]  # the paper's two shapes
    assert candidate_shapes(320, 3) == [(160, 2), (128, 3), (80, 6)]
    for m, n in candidate_shapes(320, 3):
        assert Budget(m, n).units == 320
    assert candidate_shapes(3, 0) == [(3, 0)]  # only the run's own fits


def test_shape_value_is_both_stages_expected_mixed_groups() -> None:
    v = np.array([0.5, 0.3, 0.9, 0.99])
    m = allocate_roots(v, 8)
    stage1 = contrast(v, m).sum()
    stage2 = 0.4 * 2 * (m * 2 * v * (1 - v)).sum()
    assert shape_value(v, 8, 2, 0.4) == pytest.approx(stage1 + stage2)
    assert shape_value(v, 8, 0, 0.4) == pytest.approx(stage1)


def test_the_choice_follows_the_continuation_worth() -> None:
    """Continuations that never flip (ω = 0) are worth nothing: the wider shape. Ones that flip
    as often as fresh roots (ω = 1) buy a mixed group at half a root's price: the deeper one."""
    v = np.random.default_rng(0).uniform(0.2, 0.8, 512)
    assert choose_shape(v, 128, 2, worth=0.0) == (128, 2)
    assert choose_shape(v, 128, 2, worth=1.0) == (64, 6)
    budget = Budget(128, 2)
    wide = plan("trace-auto", v, budget, np.random.default_rng(0), worth=0.0)
    deep = plan("trace-auto", v, budget, np.random.default_rng(0), worth=1.0)
    assert wide.counts.sum() == 128 and wide.units == deep.units == 256
    assert deep.counts.sum() == 64
    np.testing.assert_array_equal(deep.continuations, 6 * deep.counts)


def tree(v: float, rollout: list[float], continuations: list[float]) -> RolloutTree:
    """A root of predicted V ``v``, one rollout of two turns ending in ``rollout[0]``, and
    continuations from its first turn ending in ``continuations``."""
    builder = TreeBuilder(TreeInfo())
    builder.set_predicted_v(ROOT, v)
    first = builder.add_turn(ROOT, [1])
    builder.set_reward(builder.add_turn(first, [2]), rollout[0])
    for reward in continuations:
        builder.set_reward(builder.add_turn(first, [3], branch=True), reward)
    return builder.build()


def test_worth_is_observed_flips_over_a_fresh_roots() -> None:
    # The rollout won; a fresh root of V 0.5 would lose half the time: 2 continuations expect
    # 1 flip, and 1 happened.
    one = tree(0.5, [1.0], [0.0, 1.0])
    assert episode_rewards(one)[1] == 1.0 and episode_rewards(one)[3] == 0.0
    assert continuation_worth([one]) == pytest.approx(1.0)
    # V 0.8 and a lost rollout: a fresh root wins 0.8 of the time; 2 of 2 continuations won.
    two = tree(0.8, [0.0], [1.0, 1.0])
    assert continuation_worth([two]) == pytest.approx(2 / 1.6)
    assert continuation_worth([one, two]) == pytest.approx(3 / 2.6)
    never = tree(0.5, [1.0], [1.0, 1.0, 1.0])
    assert continuation_worth([never]) == 0.0
    flat = tree(0.5, [1.0], [])
    assert continuation_worth([flat]) is None
    assert continuation_worth([tree(math.nan, [1.0], [0.0])]) is None  # root never scored
    assert 0 < PRIOR_WORTH < 1
