"""Scoring probability forecasts of binary outcomes: Brier score and ROC AUC over outcome counts.

A forecast p_i comes with ``successes[i]`` outcomes equal to 1 and ``failures[i]`` equal to 0
(a tree node's prediction and the rewards of the leaves below it). Each outcome is one
(forecast, label) pair, so both scores are the usual ones on the expanded list of pairs,
computed without expanding it:

    brier = Σ_i [s_i (1 − p_i)² + f_i p_i²] / Σ_i (s_i + f_i)
    auc   = P(p of a random success pair > p of a random failure pair) + ½ P(tie)

Counts may be any non-negative reals (weights), not only integers.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def _checked(
    p: npt.ArrayLike, successes: npt.ArrayLike, failures: npt.ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray]:
    pa = np.asarray(p, dtype=np.float64)
    s = np.asarray(successes, dtype=np.float64)
    f = np.asarray(failures, dtype=np.float64)
    if pa.ndim != 1 or s.shape != pa.shape or f.shape != pa.shape:
        raise ValueError(
            f"p, successes, failures need one shape (N,); got {pa.shape}, {s.shape}, {f.shape}"
        )
    if (s < 0).any() or (f < 0).any():
        raise ValueError("successes and failures must be >= 0")
    return pa, s, f


def brier_score(p: npt.ArrayLike, successes: npt.ArrayLike, failures: npt.ArrayLike) -> float:
    """Mean squared error of the forecasts over every outcome; NaN without outcomes."""
    pa, s, f = _checked(p, successes, failures)
    total = float(s.sum() + f.sum())
    if total == 0:
        return float("nan")
    return float((s * (1.0 - pa) ** 2 + f * pa**2).sum() / total)


def auc(p: npt.ArrayLike, successes: npt.ArrayLike, failures: npt.ArrayLike) -> float:
    """ROC AUC with ties counted ½; NaN unless there is at least one success and one failure.

    Rank-based: group equal forecasts, then each success group beats every failure of lower
    forecast and ties with the failures of its own. O(N log N).
    """
    pa, s, f = _checked(p, successes, failures)
    total_s, total_f = float(s.sum()), float(f.sum())
    if total_s == 0 or total_f == 0:
        return float("nan")
    _, group = np.unique(pa, return_inverse=True)  # group[i]: rank of p_i among distinct values
    s_at = np.bincount(group, weights=s)  # (G,) successes per distinct forecast, ascending
    f_at = np.bincount(group, weights=f)  # (G,) failures per distinct forecast
    f_below = np.cumsum(f_at) - f_at  # failures with a strictly lower forecast
    return float((s_at * (f_below + 0.5 * f_at)).sum() / (total_s * total_f))
