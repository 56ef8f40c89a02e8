"""Budget allocation: root rollouts per prompt, and continuations per prefix.

Both stages of TRACE maximise an expected count of *mixed* reward groups under a fixed budget.

Stage 1 (roots). A prompt with success probability v that receives m rollouts yields a group
with both a success and a failure with probability

    contrast(v, m) = 1 − v^m − (1 − v)^m,

and the pool's counts solve  max Σ_i contrast(v_i, m_i)  s.t.  Σ_i m_i = M,  m_i ∈ {0} ∪ {2..M}.
``allocate_roots_dp`` is the paper's dynamic program, kept as the reference; ``allocate_roots`` is
an exact solver that is thousands of times faster (proof in its docstring).

Stage 2 (prefixes). A prefix H with predicted value v, on a rollout whose observed reward is r,
flips that reward in at least one of k fresh continuations with probability

    flip_value(r, v, k) = 1 − [r·v + (1 − r)(1 − v)]^k,

and ``allocate_prefixes`` splits one prompt's continuation budget to maximise Σ flip_value.

Departure from the paper: the formula gives contrast(v, 0) = −1; we use 0 (no rollouts, no
mixed group), which is what "m_i = 0 skips the prompt" means. contrast(v, 1) = 0 either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# (items, length) -> unit gains at positions 1..length of each item, shape (len(items), length)
GainRows = Callable[[IntArray, int], FloatArray]

_FIRST_CHUNK = 8  # units materialised per item before the first threshold search


# --- objectives ------------------------------------------------------------------------
def contrast(v: npt.ArrayLike, m: npt.ArrayLike) -> FloatArray:
    """P(m rollouts of a prompt with success probability v hold both outcomes); 0 for m < 2."""
    v_arr = np.asarray(v, dtype=np.float64)
    m_arr = np.asarray(m)
    value = 1.0 - np.power(v_arr, m_arr) - np.power(1.0 - v_arr, m_arr)
    return np.where(m_arr >= 2, value, 0.0)


def flip_value(r: npt.ArrayLike, v: npt.ArrayLike, k: npt.ArrayLike) -> FloatArray:
    """P(at least one of k continuations from a prefix with value v flips the observed reward r)."""
    r_arr = np.asarray(r, dtype=np.float64)
    v_arr = np.asarray(v, dtype=np.float64)
    same = r_arr * v_arr + (1.0 - r_arr) * (1.0 - v_arr)  # P(one continuation repeats r)
    out: FloatArray = 1.0 - np.power(same, np.asarray(k))
    return out


# --- input checks ----------------------------------------------------------------------
def _check_probabilities(name: str, v: npt.ArrayLike) -> FloatArray:
    arr = np.asarray(v, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of probabilities, got shape {arr.shape}")
    nan = np.flatnonzero(np.isnan(arr))
    if nan.size:
        raise ValueError(f"{name}[{nan[0]}] is NaN; every probability must be in [0, 1]")
    out = np.flatnonzero((arr < 0.0) | (arr > 1.0))
    if out.size:
        raise ValueError(f"{name}[{out[0]}] = {float(arr[out[0]])!r} is outside [0, 1]")
    return arr


def _check_root_budget(n_prompts: int, budget: int) -> int:
    if int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    if budget == 1:
        raise ValueError("budget 1 cannot be spent: a prompt gets 0 or at least 2 rollouts")
    if budget > 0 and n_prompts == 0:
        raise ValueError(f"budget {budget} but no prompts to spend it on")
    return int(budget)


# --- stage 1: the reference dynamic program --------------------------------------------
def allocate_roots_dp(v: npt.ArrayLike, budget: int, chunk: int = 64) -> IntArray:
    """The paper's dynamic program over prompts and spent budget: O(B·M²) time, O(B·M) memory.

    best[i][b] is the largest Σ contrast over the first i prompts spending exactly b units;
    best[i+1][b] = max over m ∈ {0, 2..b} of best[i][b − m] + contrast(v_i, m).
    Ties go to the largest m of the latest prompt. Rows of b are processed in chunks so that
    only the reachable triangle m ≤ b is touched.
    """
    v_arr = _check_probabilities("v", v)
    m_total = _check_root_budget(len(v_arr), budget)
    n = len(v_arr)
    if m_total == 0:
        return np.zeros(n, dtype=np.int64)
    counts = np.arange(m_total + 1)
    best = np.full(m_total + 1, -np.inf)
    best[0] = 0.0
    choice = np.zeros((n, m_total + 1), dtype=np.int32)
    for i in range(n):
        gain = contrast(v_arr[i], counts)
        gain[1] = -np.inf  # a lone rollout is not a group
        # windows[b, k] = best[b + k − M]: reading k = M − m gives best[b − m]
        padded = np.concatenate([np.full(m_total, -np.inf), best])
        windows = sliding_window_view(padded, m_total + 1)
        gain_rev = gain[::-1]
        new = np.empty_like(best)
        for lo in range(0, m_total + 1, chunk):
            hi = min(lo + chunk, m_total + 1)
            k0 = m_total - (hi - 1)  # m ≤ b < hi, so columns k < k0 are unreachable
            total = windows[lo:hi, k0:] + gain_rev[k0:]  # (rows, M+1−k0): best[b − m] + gain[m]
            k = np.argmax(total, axis=1)  # first maximum: the largest m among ties
            new[lo:hi] = total[np.arange(hi - lo), k]
            choice[i, lo:hi] = m_total - k0 - k
        best = new
    m = np.zeros(n, dtype=np.int64)
    left = m_total
    for i in range(n - 1, -1, -1):
        m[i] = choice[i, left]
        left -= int(m[i])
    return m


# --- the exact fast solvers ------------------------------------------------------------
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


def allocate_roots(v: npt.ArrayLike, budget: int) -> IntArray:
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
    v_arr = _check_probabilities("v", v)
    m_total = _check_root_budget(len(v_arr), budget)
    if m_total == 0:
        return np.zeros(len(v_arr), dtype=np.int64)
    units = _Units(_root_gain_rows(v_arr), len(v_arr), cap=m_total)
    m = _select_top_units(units, m_total)
    spent = int(m.sum())
    if spent < m_total:
        opened = np.flatnonzero(m >= 2)
        m[opened[0] if opened.size else 0] += m_total - spent
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
        gain_b = 2.0 * v_arr[j] * (1.0 - v_arr[j]) - float(last_gain.min())
        if gain_b > gain_a:
            m[b] -= 1
            m[j] = 2
            return m
    m[a] += 1
    return m


def allocate_prefixes(rewards: npt.ArrayLike, values: npt.ArrayLike, budget: int) -> IntArray:
    """Continuations per prefix maximising Σ_p flip_value(r_p, v_p, k_p) with Σ_p k_p = budget.

    ``rewards[p]`` is the observed reward of the rollout that prefix p lies on, ``values[p]`` the
    predicted V of the prefix. flip_value is concave in k (its k-th unit gains q^(k−1)(1−q)), so
    the budget largest unit gains are optimal: the same threshold selection as the roots, with
    no opening block and so no repair. Ties go to the lower prefix index. Budget that can flip
    nothing (q = 1 everywhere) is spread round-robin from prefix 0 so the budget is still spent.
    """
    r = _check_probabilities("rewards", rewards)
    v = _check_probabilities("values", values)
    if r.shape != v.shape:
        raise ValueError(f"rewards has {len(r)} entries but values has {len(v)}")
    if int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    k = np.zeros(len(r), dtype=np.int64)
    if budget == 0 or len(r) == 0:
        return k
    same = r * v + (1.0 - r) * (1.0 - v)
    k = _select_top_units(_Units(_prefix_gain_rows(same), len(r), cap=int(budget)), int(budget))
    left = int(budget) - int(k.sum())
    k += left // len(k)
    k[: left % len(k)] += 1
    return k
