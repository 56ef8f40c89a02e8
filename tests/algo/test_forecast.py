"""Brier score and AUC over outcome counts, against expanding every outcome into a pair."""

from __future__ import annotations

import math
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.algo.forecast import auc, brier_score


def brute_force_auc(p: list[float], s: list[int], f: list[int]) -> float:
    """Expand every outcome into a (score, label) pair and count pairs one by one."""
    pos = [pi for pi, k in zip(p, s, strict=True) for _ in range(k)]
    neg = [pi for pi, k in zip(p, f, strict=True) for _ in range(k)]
    if not pos or not neg:
        return math.nan
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in product(pos, neg))
    return wins / (len(pos) * len(neg))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0, 1)),  # ties and not
            st.integers(0, 4),
            st.integers(0, 4),
        ),
        max_size=12,
    )
)
def test_auc_and_brier_match_brute_force(cases: list[tuple[float, int, int]]) -> None:
    p = [c[0] for c in cases]
    s = [c[1] for c in cases]
    f = [c[2] for c in cases]
    expected = brute_force_auc(p, s, f)
    got = auc(np.asarray(p), np.asarray(s), np.asarray(f))
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)
    pairs = [(pi, 1.0) for pi, k in zip(p, s, strict=True) for _ in range(k)]
    pairs += [(pi, 0.0) for pi, k in zip(p, f, strict=True) for _ in range(k)]
    brier = brier_score(np.asarray(p), np.asarray(s), np.asarray(f))
    if pairs:
        assert brier == pytest.approx(sum((pi - y) ** 2 for pi, y in pairs) / len(pairs))
    else:
        assert math.isnan(brier)


def test_auc_by_hand() -> None:
    # Successes at 0.9 and 0.5, failures at 0.5 and 0.1: pairs (0.9,0.5) (0.9,0.1) (0.5,0.1)
    # win, (0.5,0.5) ties → (3 + 0.5) / 4.
    assert auc([0.9, 0.5, 0.1], [1, 1, 0], [0, 1, 1]) == pytest.approx(3.5 / 4)
    assert auc([0.2, 0.8], [0, 3], [2, 0]) == 1.0
    assert auc([0.2, 0.8], [3, 0], [0, 2]) == 0.0
    assert math.isnan(auc([0.3], [2], [0]))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        auc([0.1, 0.2], [1], [0, 1])
    with pytest.raises(ValueError, match=">= 0"):
        brier_score([0.1], [-1], [0])
