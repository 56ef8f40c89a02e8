"""The exact greedy behind ``allocate_roots`` and ``allocate_prefixes``: the budget largest unit
gains, found with one threshold instead of a heap, plus the repair of a last odd root unit.

Both objectives split into per-unit gains that never increase along an item (a prompt or a
prefix), so taking the budget largest gains over all items is the heap greedy's answer and is
optimal; ``solve_roots`` also proves the repair that the roots' "no lone rollout" rule needs.
Inputs here are already checked (``trace_core.algo.allocate`` does that): probabilities in [0, 1]
and a budget ≥ 2 for the roots, ≥ 1 for the prefixes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# (items, length) -> unit gains at positions 1..length of each item, shape (len(items), length)
GainRows = Callable[[IntArray, int], FloatArray]

_FIRST_CHUNK = 8  # units materialised per item before the first threshold search


# --- unit gains ------------------------------------------------------------------------
def _powers(base: FloatArray, length: int) -> FloatArray:
    """base^(k−1) for k = 1..length, one row per base: (n,) -> (n, length). Cumulative products
    are monotone in floating point (x·b ≤ x for b ≤ 1), unlike ``np.power`` near b = 1."""
    out = np.empty((len(base), length))
    out[:, 0] = 1.0
    out[:, 1:] = base[:, None]
    powers: FloatArray = np.cumprod(out, axis=1, dtype=np.float64)
    return powers


def _root_gain_rows(v: FloatArray) -> GainRows:
    """Per-unit gains of adding rollouts to one prompt, with the opening pair linearised.

    Units 1 and 2 (the opening pair) each gain g = v(1−v) = contrast(v, 2)/2; unit k ≥ 3 gains
    Δ(k) = contrast(v, k) − contrast(v, k−1) = v^(k−1)(1−v) + (1−v)^(k−1) v, which equals g at
    k = 3 and falls from there. Clamping at g keeps the sequence non-increasing in floating point
    too, which the selection relies on.
    """

    def rows(items: IntArray, length: int) -> FloatArray:
        vi = v[items]
        w = 1.0 - vi
        g = (vi * w)[:, None]
        gains = _powers(vi, length) * w[:, None] + _powers(w, length) * vi[:, None]
        gains[:, :3] = g
        return np.minimum(gains, g)

    return rows


def _prefix_gain_rows(same: FloatArray) -> GainRows:
    """Gain of the k-th continuation from a prefix: q^(k−1)(1−q), q = P(one repeats the reward)."""

    def rows(items: IntArray, length: int) -> FloatArray:
        q = same[items]
        return _powers(q, length) * (1.0 - q)[:, None]

    return rows


class _Units:
    """Materialised unit gains: for each length L, the items materialised to L and their
    (items, L) gain rows. Items start at ``_FIRST_CHUNK`` units and double on demand."""

    def __init__(self, gain_rows: GainRows, n_items: int, cap: int) -> None:
        self.gain_rows = gain_rows
        self.cap = cap
        self.length = np.full(n_items, min(_FIRST_CHUNK, cap), dtype=np.int64)
        self.row = np.arange(n_items, dtype=np.int64)  # row of each item in its length's block
        length = int(self.length[0]) if n_items else 0
        self.blocks: dict[int, tuple[IntArray, FloatArray]] = {
            length: (np.arange(n_items, dtype=np.int64), gain_rows(np.arange(n_items), length))
        }

    def extend(self, items: IntArray) -> None:
        """Double the materialised length of ``items`` (at most ``cap``)."""
        moved = np.zeros(len(self.length), dtype=bool)
        moved[items] = True
        for length, (members, gains) in list(self.blocks.items()):
            keep = ~moved[members]
            self.blocks[length] = (members[keep], gains[keep])
        self.length[items] = np.minimum(2 * self.length[items], self.cap)
        for length in np.unique(self.length[items]):
            group = items[self.length[items] == length]
            members, gains = self.blocks.get(int(length), (items[:0], np.zeros((0, length))))
            self.blocks[int(length)] = (
                np.concatenate([members, group]),
                np.concatenate([gains, self.gain_rows(group, int(length))]),
            )
        for members, _ in self.blocks.values():
            self.row[members] = np.arange(len(members))

    def all_gains(self) -> FloatArray:
        return np.concatenate([gains.ravel() for _, gains in self.blocks.values()])

    def at(self, items: IntArray, pos: IntArray) -> FloatArray:
        """Gain of unit ``pos`` (0-based) of each item."""
        out = np.empty(len(items))
        for length, (_, gains) in self.blocks.items():
            here = self.length[items] == length
            out[here] = gains[self.row[items[here]], pos[here]]
        return out

    def last(self) -> FloatArray:
        return self.at(np.arange(len(self.length)), self.length - 1)

    def count_above(self, threshold: float) -> IntArray:
        """Units per item with gain > threshold."""
        counts = np.zeros(len(self.length), dtype=np.int64)
        for members, gains in self.blocks.values():
            counts[members] = np.count_nonzero(gains > threshold, axis=1)
        return counts

    def ties(self, threshold: float) -> tuple[IntArray, IntArray]:
        """(item, position) of every unit whose gain equals ``threshold``."""
        found = [
            (members[r], c)
            for members, gains in self.blocks.values()
            for r, c in [np.nonzero(gains == threshold)]
        ]
        return (
            np.concatenate([f[0] for f in found]).astype(np.int64),
            np.concatenate([f[1] for f in found]).astype(np.int64),
        )


# --- the threshold form of the heap greedy ---------------------------------------------
def _select_top_units(units: _Units, budget: int) -> IntArray:
    """Counts per item of the ``budget`` largest positive unit gains, in the order
    (gain descending, item ascending, position ascending); fewer when positive units run out.

    Because every item's gains are non-increasing, a threshold λ = the budget-th largest gain
    selects a prefix of every item: the same set a heap greedy pops one unit at a time. Items
    whose every materialised unit is at or above λ might have more such units, so they are
    extended and λ recomputed until no item is saturated.
    """
    while True:
        gains = units.all_gains()
        n_positive = int(np.count_nonzero(gains > 0.0))
        threshold = 0.0 if n_positive <= budget else float(np.partition(gains, -budget)[-budget])
        last = units.last()
        saturated = (units.length < units.cap) & (last > 0.0) & (last >= threshold)
        if not saturated.any():
            break
        units.extend(np.flatnonzero(saturated))
    counts = units.count_above(threshold)
    if n_positive <= budget:
        return counts
    item, pos = units.ties(threshold)
    order = np.lexsort((pos, item))[: budget - int(counts.sum())]
    counts += np.bincount(item[order], minlength=len(counts))
    return counts


def solve_prefixes(same: FloatArray, budget: int) -> IntArray:
    """Continuations per prefix: the ``budget`` largest gains q^(k−1)(1−q), q = ``same``.

    Concave per prefix, so the selection alone is optimal; ties go to the lower prefix index.
    Returns fewer than ``budget`` in all when positive gains run out (q = 1 everywhere).
    """
    return _select_top_units(_Units(_prefix_gain_rows(same), len(same), cap=budget), budget)


# --- stage 1: greedy plus the repair of a lone unit ------------------------------------
def solve_roots(v: FloatArray, budget: int) -> IntArray:
    """Root rollouts per prompt maximising Σ contrast(v_i, m_i), Σ m_i = budget, m_i ∉ {1}. Exact.

    Why a greedy works. Write each prompt's value as a sum of per-unit gains u(1), u(2), ...:
    the opening pair gains 2g (g = v(1−v)), so give each of its two units g; then u(3) = g and
    u(k) = Δ(k) falls with k (``_root_gain_rows``). Gains are non-increasing along every prompt,
    so the *relaxed* problem, which also allows m_i = 1 worth g, is solved by the budget largest
    units overall (the heap greedy; here one threshold, ``_select_top_units``). Taken in the order
    (gain ↓, prompt ↑, position ↑), a prompt's first three units (all worth g) are adjacent, so
    at most one prompt j ends with a single unit and it is the last one taken. If there is none,
    the relaxed optimum is feasible, hence optimal.

    Repair. Otherwise drop j's unit: G holds budget − 1 units, every open prompt has ≥ 3 (its
    third unit, worth g_i ≥ g_j, precedes j's first), every unit in G gains ≥ g_j and every unit
    outside gains ≤ g_j. One unit must be added. The candidates are
      (A) G + the best next unit of an open prompt, gain δ_A ≤ g_j;
      (B) G + j's opening pair (2 g_j) − the smallest last unit of an open prompt (δ_min ≥ g_j).
    Any feasible T with budget units is no better. Let S = G's units. If T opens no prompt that G
    leaves shut, every unit of T∖S is a next unit of an open prompt, so gains ≤ δ_A ≤ g_j, and
    |T∖S| = |S∖T| + 1 with every unit of S∖T ≥ g_j:  Σ(T∖S) − Σ(S∖T) ≤ (|S∖T| + 1)δ_A − |S∖T| g_j
    ≤ δ_A. If T opens a new prompt, T∖S has ≥ 2 units, so S∖T is not empty, every unit of T∖S
    gains ≤ g_j, and of the units of S∖T one gains ≥ δ_min and the rest ≥ g_j:
    Σ(T∖S) − Σ(S∖T) ≤ (|S∖T| + 1) g_j − δ_min − (|S∖T| − 1) g_j = 2 g_j − δ_min. So the better
    of (A) and (B) is optimal; ties go to (A).

    When positive gains run out (v ∈ {0, 1}, or gains underflow) the rest of the budget adds
    nothing wherever it goes; it goes to the lowest-numbered open prompt (or prompt 0).
    """
    units = _Units(_root_gain_rows(v), len(v), cap=budget)
    m = _select_top_units(units, budget)
    spent = int(m.sum())
    if spent < budget:
        opened = np.flatnonzero(m >= 2)
        m[opened[0] if opened.size else 0] += budget - spent
        return m
    single = np.flatnonzero(m == 1)
    if single.size == 0:
        return m
    j = int(single[0])
    m[j] = 0
    opened = np.flatnonzero(m >= 2)
    next_gain = units.at(opened, m[opened])  # unit m_i + 1 is materialised: see _select_top_units
    a = int(opened[np.argmax(next_gain)])  # first maximum: lowest prompt id
    gain_a = float(next_gain.max())
    shrinkable = opened[m[opened] >= 3]
    if shrinkable.size:
        last_gain = units.at(shrinkable, m[shrinkable] - 1)
        b = int(shrinkable[::-1][np.argmin(last_gain[::-1])])  # smallest; ties: highest prompt id
        gain_b = 2.0 * v[j] * (1.0 - v[j]) - float(last_gain.min())
        if gain_b > gain_a:
            m[b] -= 1
            m[j] = 2
            return m
    m[a] += 1
    return m
