"""``trace-rl bench allocator-speed``: the paper's dynamic program against the exact fast solver.

Both solve the same stage-1 problem on v ~ Beta(0.4, 0.4) with M = 4B. The DP costs O(B·M²),
so sizes past ``dp_max_prompts`` are not run; for those the table prints an estimate scaled
from the largest DP actually measured, marked as an estimate. The fast solver also runs alone
at B = 1,000,000. Every solved instance is checked: both allocations spend exactly M, and
where the DP ran their objectives agree to 1e-9.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from trace_core.algo.allocate import allocate_roots, allocate_roots_dp, contrast

DEFAULT_SIZES = (256, 2048, 16384)
LARGE_SIZE = 1_000_000


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


def run_allocator_speed(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    large: int | None = LARGE_SIZE,
    dp_max_prompts: int = 2048,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[SpeedRow]:
    rng = np.random.default_rng(seed)
    rows: list[SpeedRow] = []
    measured: tuple[int, int, float] | None = None  # (B, M, seconds) of the largest DP run
    for b in (*sizes, *((large,) if large else ())):
        m = 4 * b
        v = rng.beta(0.4, 0.4, size=b)
        allocate_roots(v[: min(b, 64)], min(m, 256))  # warm numpy's code paths
        fast, fast_s = _timed(lambda v=v, m=m: allocate_roots(v, m))
        if int(fast.sum()) != m or (fast == 1).any():
            raise AssertionError(f"fast solver broke the constraints at B={b}")
        dp_s = estimate = speedup = gap = None
        if b in sizes and b <= dp_max_prompts:
            if progress:
                progress(f"DP at B={b}, M={m}")
            dp, dp_s = _timed(lambda v=v, m=m: allocate_roots_dp(v, m))
            gap = abs(float(contrast(v, fast).sum() - contrast(v, dp).sum()))
            if gap > 1e-9:
                raise AssertionError(f"fast solver is not optimal at B={b}: gap {gap:.3g}")
            speedup = dp_s / fast_s
            measured = (b, m, dp_s)
        elif b in sizes and measured is not None:
            b0, m0, s0 = measured
            estimate = s0 * (b / b0) * (m / m0) ** 2
        rows.append(SpeedRow(b, m, fast_s, dp_s, estimate, speedup, gap))
    return rows


def rows_to_json(rows: list[SpeedRow]) -> dict[str, object]:
    return {"rows": [asdict(r) for r in rows]}
