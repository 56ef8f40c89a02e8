"""``trace-rl bench allocator-speed``: the paper's dynamic program against the exact fast solver.

Both solve the same stage-1 problem on v ~ Beta(0.4, 0.4) with M = 4B. The DP is the reference,
a plain Python loop costing O(B·M²) (about 20 s at B = 256 on two cores), so sizes past
``dp_max_prompts`` (``DP_MAX_PROMPTS`` by default) are not run; for those the table prints an
estimate scaled from the largest DP actually measured, marked as an estimate. The fast solver
also runs alone at B = 1,000,000. Every solved instance is checked: both allocations spend
exactly M, and where the DP ran their objectives agree to 1e-9.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import numpy as np

from trace_core.algo.allocate import allocate_roots, allocate_roots_dp, contrast

DEFAULT_SIZES = (256, 2048, 16384)
LARGE_SIZE = 1_000_000
DP_MAX_PROMPTS = 256  # the DP runs at B = 256 only; 2048 would take hours, so it is estimated


@dataclass(frozen=True)
class SpeedRow:
    prompts: int
    budget: int
    fast_seconds: float
    dp_seconds: float | None  # None: not run
    dp_estimated_seconds: float | None  # scaled from a measured DP when this one was not run
    speedup: float | None  # dp_seconds / fast_seconds, measured only
    objective_gap: float | None  # |fast − DP| objective, measured only


def _timed(solve: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    out = solve()
    return out, time.perf_counter() - start


def _time_fast(v: np.ndarray, m: int) -> tuple[np.ndarray, float]:
    allocate_roots(v[: min(len(v), 64)], min(m, 256))  # warm numpy's code paths
    fast, seconds = _timed(lambda: allocate_roots(v, m))
    if int(fast.sum()) != m or (fast == 1).any():
        raise AssertionError(f"fast solver broke the constraints at B={len(v)}")
    return fast, seconds


def run_allocator_speed(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    large: int | None = LARGE_SIZE,
    dp_max_prompts: int = DP_MAX_PROMPTS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[SpeedRow]:
    """One row per size (DP and fast solver), then the fast solver alone at ``large``."""
    bad = [b for b in (*sizes, *((large,) if large else ())) if b < 1]
    if bad:
        raise ValueError(f"pool sizes must be >= 1, got {bad[0]}")
    rng = np.random.default_rng(seed)
    measured = []
    for b in sorted(sizes):
        m = 4 * b
        v = rng.beta(0.4, 0.4, size=b)
        fast, fast_s = _time_fast(v, m)
        dp_s = speedup = gap = None
        if b <= dp_max_prompts:
            if progress:
                progress(f"DP at B={b}, M={m}")
            dp, dp_s = _timed(partial(allocate_roots_dp, v, m))
            gap = abs(float(contrast(v, fast).sum() - contrast(v, dp).sum()))
            if gap > 1e-9:
                raise AssertionError(f"fast solver is not optimal at B={b}: gap {gap:.3g}")
            speedup = dp_s / fast_s
        measured.append(SpeedRow(b, m, fast_s, dp_s, None, speedup, gap))
    rows = [_with_estimate(row, measured) for row in measured]
    if large:
        _, fast_s = _time_fast(rng.beta(0.4, 0.4, size=large), 4 * large)
        rows.append(SpeedRow(large, 4 * large, fast_s, None, None, None, None))
    return rows


def _with_estimate(row: SpeedRow, rows: list[SpeedRow]) -> SpeedRow:
    """A DP that was not run gets a time scaled as B·M² from the largest DP that was."""
    ran = [r for r in rows if r.dp_seconds is not None]
    if row.dp_seconds is not None or not ran:
        return row
    base = max(ran, key=lambda r: r.prompts)
    assert base.dp_seconds is not None
    scale = (row.prompts / base.prompts) * (row.budget / base.budget) ** 2
    return replace(row, dp_estimated_seconds=base.dp_seconds * scale)


def rows_to_json(rows: list[SpeedRow]) -> dict[str, object]:
    return {"rows": [asdict(r) for r in rows]}
