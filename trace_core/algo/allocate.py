"""Budget allocation: root rollouts per prompt, and continuations per prefix.

Both stages of TRACE maximise an expected count of *mixed* reward groups under a fixed budget.

Stage 1 (roots). A prompt with success probability v that receives m rollouts yields a group
with both a success and a failure with probability

    contrast(v, m) = 1 − v^m − (1 − v)^m,

and the pool's counts solve  max Σ_i contrast(v_i, m_i)  s.t.  Σ_i m_i = M,  m_i ∈ {0} ∪ {2..M}.
``allocate_roots_dp`` is the paper's dynamic program as a plain loop, kept as the reference;
``allocate_roots`` is an exact greedy that is thousands of times faster (``trace_core.algo.greedy``,
proof in ``solve_roots``).

Stage 2 (prefixes). A prefix H with predicted value v, on a rollout whose observed reward is r,
flips that reward in at least one of k fresh continuations with probability

    flip_value(r, v, k) = 1 − [r·v + (1 − r)(1 − v)]^k,

and ``allocate_prefixes`` splits one prompt's continuation budget to maximise Σ flip_value.

Departure from the paper: the formula gives contrast(v, 0) = −1; we use 0 (no rollouts, no
mixed group), which is what "m_i = 0 skips the prompt" means. contrast(v, 1) = 0 either way.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from trace_core.algo.greedy import solve_prefixes, solve_roots

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


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


# --- stage 1 ---------------------------------------------------------------------------
def allocate_roots(v: npt.ArrayLike, budget: int) -> IntArray:
    """Root rollouts per prompt maximising Σ contrast(v_i, m_i), Σ m_i = budget, m_i ∉ {1}. Exact.

    The greedy on per-unit gains with a one-unit repair, ``trace_core.algo.greedy.solve_roots``
    (proof in its docstring): the optimum of ``allocate_roots_dp`` at a tiny fraction of its cost.
    """
    v_arr = _check_probabilities("v", v)
    m_total = _check_root_budget(len(v_arr), budget)
    if m_total == 0:
        return np.zeros(len(v_arr), dtype=np.int64)
    return solve_roots(v_arr, m_total)


def allocate_roots_dp(v: npt.ArrayLike, budget: int) -> IntArray:
    """The reference: the paper's dynamic program as a plain loop, O(B·M²) on purpose.

    F[i][b] is the largest Σ contrast over the first i prompts spending exactly b units:
    F[0][0] = 0, F[0][b > 0] = −∞, and
        F[i][b] = max over m ∈ {0} ∪ {2..b} of F[i−1][b − m] + contrast(v_i, m).
    pick[i][b] remembers the maximising m (ties: the largest), and walking back from F[B][M]
    recovers the counts. Nothing is vectorised, so it is slow and easy to check by eye; the
    tests hold ``allocate_roots`` to its optimum on small instances.
    """
    v_arr = _check_probabilities("v", v)
    m_total = _check_root_budget(len(v_arr), budget)
    n = len(v_arr)
    if m_total == 0:
        return np.zeros(n, dtype=np.int64)
    f_prev = [0.0] + [-math.inf] * m_total  # F[0]
    pick: list[list[int]] = []
    for i in range(n):
        gain = contrast(v_arr[i], np.arange(m_total + 1)).tolist()  # contrast(v_i, m), m = 0..M
        f_row = [-math.inf] * (m_total + 1)
        pick_row = [0] * (m_total + 1)
        for b in range(m_total + 1):
            for m in range(b + 1):
                if m == 1:
                    continue  # a lone rollout is not a group
                value = f_prev[b - m] + gain[m]
                if value >= f_row[b]:  # >=: among ties the later, larger m wins
                    f_row[b] = value
                    pick_row[b] = m
        pick.append(pick_row)
        f_prev = f_row
    m_out = np.zeros(n, dtype=np.int64)
    left = m_total
    for i in range(n - 1, -1, -1):
        m_out[i] = pick[i][left]
        left -= pick[i][left]
    return m_out


# --- stage 2 ---------------------------------------------------------------------------
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
    k = solve_prefixes(same, int(budget))
    left = int(budget) - int(k.sum())
    k += left // len(k)
    k[: left % len(k)] += 1
    return k
