"""Allocation: worked examples, fast solver vs the paper's DP, prefixes vs brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.algo.allocate import (
    allocate_prefixes,
    allocate_roots,
    allocate_roots_dp,
    contrast,
    flip_value,
)


# --- the objectives ----------------------------------------------------------------------
def test_contrast_worked_values() -> None:
    # v = 0.5, m = 2: 1 − 0.25 − 0.25 = 0.5;  m = 3: 1 − 0.125 − 0.125 = 0.75
    # v = 0.2, m = 2: 1 − 0.04 − 0.64 = 0.32; m = 0 and m = 1 hold no group: 0
    got = contrast([0.5, 0.5, 0.2, 0.2, 0.2], [2, 3, 2, 0, 1])
    np.testing.assert_allclose(got, [0.5, 0.75, 0.32, 0.0, 0.0])


def test_flip_value_worked_values() -> None:
    # r = 1, v = 0.9: a continuation repeats the success w.p. 0.9, so 1 − 0.9² = 0.19 for k = 2
    # r = 0, v = 0.9: it repeats the failure w.p. 0.1, so 1 − 0.1 = 0.9 for k = 1
    # k = 0 flips nothing
    got = flip_value([1, 0, 0], [0.9, 0.9, 0.5], [2, 1, 0])
    np.testing.assert_allclose(got, [0.19, 0.9, 0.0])


def test_objectives_broadcast_like_loops() -> None:
    rng = np.random.default_rng(0)
    v, r, k = rng.random(50), rng.integers(0, 2, 50), rng.integers(0, 6, 50)
    loop_c = [0.0 if k_ < 2 else 1 - v_**k_ - (1 - v_) ** k_ for v_, k_ in zip(v, k, strict=True)]
    loop_f = [1 - (r_ * v_ + (1 - r_) * (1 - v_)) ** k_ for r_, v_, k_ in zip(r, v, k, strict=True)]
    np.testing.assert_allclose(contrast(v, k), loop_c)
    np.testing.assert_allclose(flip_value(r, v, k), loop_f)


# --- stage 1 -----------------------------------------------------------------------------
def test_roots_worked_example() -> None:
    # v = [0.5, 0.5, 0.99], M = 6. Per-unit gains: prompt 0 and 1 open at g = 0.25 per unit
    # (pair worth 0.5), 3rd unit 0.25, 4th 0.125; prompt 2 opens at g = 0.0099.
    # Best: 3 + 3 + 0 = 0.75 + 0.75 = 1.5; 4 + 2 would give 0.875 + 0.5 = 1.375.
    m = allocate_roots([0.5, 0.5, 0.99], 6)
    assert m.tolist() == [3, 3, 0]
    assert contrast([0.5, 0.5, 0.99], m).sum() == pytest.approx(1.5)


def test_roots_odd_unit_repair() -> None:
    # v = [0.5, 0.4], M = 5. Greedy by unit: prompt 0's three units (0.25 each), then
    # prompt 1's pair (0.24 per unit) needs 2 units but only 2 remain → [3, 2] fits exactly.
    # M = 4: prompt 0's three units, then one unit left and prompt 1's pair does not fit.
    #   (A) a 4th unit on prompt 0:        0.75 + 0.125 = 0.875
    #   (B) drop one, open prompt 1: 0.5 + 2·0.24 = 0.98  ← optimal, [2, 2]
    assert allocate_roots([0.5, 0.4], 5).tolist() == [3, 2]
    assert allocate_roots([0.5, 0.4], 4).tolist() == [2, 2]
    # With prompt 1 at 0.05 (pair worth 0.095), (A) wins: 0.875 > 0.5 + 0.095.
    assert allocate_roots([0.5, 0.05], 4).tolist() == [4, 0]


def test_roots_skip_saturated_prompts() -> None:
    # Prompts certain to succeed or fail hold no contrast: nothing goes there.
    m = allocate_roots([0.0, 0.5, 1.0, 0.6], 8)
    assert m[0] == 0 and m[2] == 0 and m.sum() == 8


def test_roots_degenerate_budget_goes_somewhere_valid() -> None:
    # All gains are zero: any split is optimal; it must still spend M with no lone rollout.
    m = allocate_roots([0.0, 1.0, 0.0], 5)
    assert m.sum() == 5 and not (m == 1).any()


@pytest.mark.parametrize(
    ("v", "budget", "message"),
    [
        ([0.5, 0.5], 1, "budget 1"),
        ([0.5, float("nan")], 4, r"v\[1\] is NaN"),
        ([0.5, 0.2, 1.5], 4, r"v\[2\] = 1.5 is outside \[0, 1\]"),
        ([-0.1], 4, r"v\[0\]"),
        ([0.5], -2, "non-negative"),
        ([], 4, "no prompts"),
        ([[0.5]], 4, "1-D"),
    ],
)
@pytest.mark.parametrize("solver", [allocate_roots, allocate_roots_dp])
def test_roots_reject_bad_input(solver, v, budget, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        solver(v, budget)


def test_roots_zero_budget() -> None:
    assert allocate_roots([0.3, 0.4], 0).tolist() == [0, 0]
    assert allocate_roots_dp([0.3, 0.4], 0).tolist() == [0, 0]


def test_dp_worked_table() -> None:
    # v = [0.5, 0.4], M = 4. Row F[1] (prompt 0, v = 0.5), b = 0..4:
    #   [0, −∞, 0.5, 0.75, 0.875]   (b = 1 is a lone rollout: unreachable)
    # contrast(0.4, m): m = 2: 1 − 0.16 − 0.36 = 0.48;  m = 4: 1 − 0.0256 − 0.1296 = 0.8448
    # F[2][4] = max(m = 0: 0.875 + 0,  m = 2: F[1][2] + 0.48 = 0.98,
    #               m = 3: F[1][1] + … = −∞,  m = 4: F[1][0] + 0.8448 = 0.8448) = 0.98
    # Back-pointers: prompt 1 takes 2, leaving b = 2 for prompt 0 → [2, 2].
    m = allocate_roots_dp([0.5, 0.4], 4)
    assert m.tolist() == [2, 2]
    assert contrast([0.5, 0.4], m).sum() == pytest.approx(0.98)


def test_dp_ties_go_to_the_largest_count_of_the_latest_prompt() -> None:
    # v = [0.5, 0.5], M = 5. F[1] = [0, −∞, 0.5, 0.75, 0.875, 0.9375] (contrast(0.5, 5) = 1 − 2/32).
    # F[2][5]: m = 0: 0.9375; m = 2: F[1][3] + 0.5 = 1.25; m = 3: F[1][2] + 0.75 = 1.25;
    #          m = 5: 0 + 0.9375. The tie at 1.25 (exact in binary) goes to m = 3 → [2, 3].
    assert allocate_roots_dp([0.5, 0.5], 5).tolist() == [2, 3]


def _probabilities(n: int) -> st.SearchStrategy[list[float]]:
    grid = st.sampled_from([0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0])  # forces ties
    return st.lists(st.one_of(grid, st.floats(0.0, 1.0)), min_size=1, max_size=n)


@settings(max_examples=200, deadline=None)
@given(v=_probabilities(3), budget=st.integers(0, 8).filter(lambda b: b != 1))
def test_dp_matches_brute_force(v: list[float], budget: int) -> None:
    # Every split of the budget with no lone rollout, scored directly.
    splits = [
        m
        for m in itertools.product(range(budget + 1), repeat=len(v))
        if sum(m) == budget and 1 not in m
    ]
    best = max(float(contrast(v, np.asarray(m)).sum()) for m in splits)
    assert contrast(v, allocate_roots_dp(v, budget)).sum() == pytest.approx(best, abs=1e-12)


@settings(max_examples=2000, deadline=None)
@given(v=_probabilities(7), budget=st.integers(0, 30).filter(lambda b: b != 1))
@pytest.mark.slow
def test_fast_solver_matches_dp(v: list[float], budget: int) -> None:
    fast = allocate_roots(v, budget)
    dp = allocate_roots_dp(v, budget)
    for m in (fast, dp):
        assert m.sum() == budget
        assert not (m == 1).any()
        assert (m >= 0).all()
    assert contrast(v, fast).sum() == pytest.approx(contrast(v, dp).sum(), abs=1e-9)


def test_fast_solver_matches_dp_on_larger_pools() -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        b = int(rng.integers(5, 60))
        v = rng.beta(0.4, 0.4, size=b)
        budget = int(rng.integers(2, 4 * b))
        fast, dp = allocate_roots(v, budget), allocate_roots_dp(v, budget)
        assert contrast(v, fast).sum() == pytest.approx(contrast(v, dp).sum(), abs=1e-9)


def test_fast_solver_extends_a_single_prompt_to_the_whole_budget() -> None:
    # One prompt takes everything: far past the first materialised chunk of units.
    assert allocate_roots([0.5], 1000).tolist() == [1000]
    assert allocate_roots([0.5, 0.0], 999).tolist() == [999, 0]


def test_fast_solver_is_deterministic_under_ties() -> None:
    v = np.full(10, 0.5)
    first = allocate_roots(v, 9)
    assert all(np.array_equal(first, allocate_roots(v, 9)) for _ in range(3))
    # equal prompts: the lowest ids are opened first (3 units each: 0.25, 0.25, 0.25)
    assert first.tolist() == [3, 3, 3, 0, 0, 0, 0, 0, 0, 0]


# --- stage 2 -----------------------------------------------------------------------------
def _brute_force_prefixes(r: list[float], v: list[float], budget: int) -> float:
    best = -1.0
    for k in itertools.product(range(budget + 1), repeat=len(r)):
        if sum(k) == budget:
            best = max(best, float(flip_value(r, v, np.asarray(k)).sum()))
    return best


def test_prefixes_worked_example() -> None:
    # Two prefixes of a failed rollout (r = 0): v = 0.8 flips w.p. 0.8 per continuation,
    # v = 0.1 w.p. 0.1. Unit gains: prefix 0: 0.8, 0.16, 0.032; prefix 1: 0.1, 0.09.
    # Budget 3 takes 0.8, 0.16, 0.1 → k = [2, 1].
    assert allocate_prefixes([0, 0], [0.8, 0.1], 3).tolist() == [2, 1]


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)), min_size=1, max_size=4
    ),
    budget=st.integers(0, 6),
)
def test_prefixes_match_brute_force(data: list[tuple[float, float]], budget: int) -> None:
    r = [d[0] for d in data]
    v = [d[1] for d in data]
    k = allocate_prefixes(r, v, budget)
    assert k.sum() == budget and (k >= 0).all()
    assert flip_value(r, v, k).sum() == pytest.approx(_brute_force_prefixes(r, v, budget), abs=1e-9)


def test_prefixes_spend_budget_that_can_flip_nothing() -> None:
    # r = 1 with v = 1: every continuation repeats the success; still spend all 5, round-robin.
    assert allocate_prefixes([1, 1], [1.0, 1.0], 5).tolist() == [3, 2]


def test_prefixes_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="rewards has 2 entries but values has 1"):
        allocate_prefixes([0, 1], [0.5], 2)
    with pytest.raises(ValueError, match=r"values\[0\] is NaN"):
        allocate_prefixes([0], [float("nan")], 2)
    with pytest.raises(ValueError, match="non-negative"):
        allocate_prefixes([0], [0.5], -1)
    assert allocate_prefixes([], [], 3).tolist() == []
