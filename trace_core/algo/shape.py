"""``trace-auto``: the budget's shape M × N chosen for each iteration from the predicted contrast.

The paper shows the shape matters (at equal units M(1 + N/2), its wider roots beat deeper
expansion) and leaves it to the user. TRACE's two stages maximise one quantity, the expected
number of mixed sibling groups, so a shape is scored by what they would make of it:

    value(M, N) = Σ_i contrast(v_i, m_i)  +  ω · N · Σ_i m_i · 2 v_i (1 − v_i),

with m = ``allocate_roots(v, M)`` (stage 1 on the pool's predicted V). The first term is the
root groups stage 1 expects to mix. The second is stage 2's prefix groups: prompt i's m_i·N
continuations each flip the reward of the rollout they leave with probability r(1 − v) +
(1 − r)v if a continuation were a fresh root (2v(1 − v) averaged over r), and ω, the
*continuation worth*, is how often real continuations flip against that: below 1 when a prefix
already decides the outcome (the continuations repeat its reward), above 1 when prefixes are
more uncertain than their prompt. ω is measured on the trees the predictor is fitted on
(``continuation_worth``), so the choice follows what stage 2 delivered in earlier iterations.

The candidates are the shapes that spend exactly the iteration's units: N in ``SHAPES`` (and
the run's own N) with M = units / (1 + N/2) a whole number ≥ 2; for M = 128, N = 2 these are
128 × 2 and 64 × 6, the paper's two shapes. Ties go to the wider shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from trace_core.algo.allocate import allocate_roots, contrast
from trace_core.algo.tree import CONTINUATION_UNIT, ROOT, ROOT_UNIT, RolloutTree

FloatArray = npt.NDArray[np.float64]

SHAPES = (2, 4, 6)
"""Continuations per root ``trace-auto`` considers, besides the run's own."""
PRIOR_WORTH = 0.5
"""ω before any tree was seen: a continuation flips half as often as a fresh root would."""
MAX_WORTH = 2.0


def shape_value(v: npt.ArrayLike, roots: int, continuations: int, worth: float) -> float:
    """Expected mixed sibling groups of an M × N iteration over prompts of predicted V ``v``."""
    p = np.asarray(v, dtype=np.float64)
    m = allocate_roots(p, roots)
    stage1 = float(contrast(p, m).sum())
    stage2 = worth * continuations * float((m * 2.0 * p * (1.0 - p)).sum())
    return stage1 + stage2


def candidate_shapes(units: float, continuations: int) -> list[tuple[int, int]]:
    """(M, N) pairs that spend exactly ``units``, N from ``SHAPES`` and ``continuations``."""
    shapes = []
    for n in sorted({continuations, *SHAPES}):
        m = units / (ROOT_UNIT + CONTINUATION_UNIT * n)
        if m >= 2 and math.isclose(m, round(m)):
            shapes.append((round(m), n))
    return shapes


def choose_shape(v: npt.ArrayLike, roots: int, continuations: int, worth: float) -> tuple[int, int]:
    """The (M, N) of the run's units M(1 + N/2) with the largest ``shape_value``."""
    units = roots * (ROOT_UNIT + CONTINUATION_UNIT * continuations)
    shapes = candidate_shapes(units, continuations)
    return max(shapes, key=lambda s: (shape_value(v, s[0], s[1], worth), s[0]))


def episode_rewards(tree: RolloutTree) -> FloatArray:
    """Per node, the reward of the episode that made it: its own (not branched) turns lead to
    one leaf. One pass from the last node up (``parent[i] < i``)."""
    reward = tree.reward.copy()
    for node in range(tree.size - 1, 0, -1):
        if not tree.branch[node]:
            reward[tree.parent[node]] = reward[node]
    return reward


def continuation_worth(trees: Iterable[RolloutTree]) -> float | None:
    """Observed flips of the trees' continuations over the flips fresh roots of the predicted
    prompt V would give (ω of the module docstring); None without a scored continuation."""
    flips = expected = 0.0
    for tree in trees:
        v = float(tree.predicted_v[ROOT])
        if math.isnan(v):
            continue
        episode = episode_rewards(tree)
        for start in np.flatnonzero(tree.branch):
            r = float(episode[tree.parent[start]])
            flips += float(episode[start] != r)
            expected += r * (1.0 - v) + (1.0 - r) * v
    if expected <= 0:
        return None
    return min(flips / expected, MAX_WORTH)
