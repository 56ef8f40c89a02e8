"""The allocation benchmark's claim, on the simulator with its fixed seeds: at an equal budget,
``trace`` buys at least twice ``grpo``'s mixed groups per 100 rollout units and at least 80% of
what ``oracle`` (which reads the true V) buys.

The figures behind the margins are in the test's docstring; rerun them with
``trace-rl bench allocation --prompts 512 --budget 256 --seeds 4 --strategies grpo,trace,oracle``
(the strategy list matters: each strategy's sampling stream is seeded by its place in it).
"""

from __future__ import annotations

import pytest

from trace_core.bench.allocation import AllocationBenchConfig, run_allocation_bench


@pytest.mark.slow  # 8–16 s on 2 shared cores; `make test` runs it
def test_trace_beats_grpo_twice_over_and_reaches_most_of_oracle() -> None:
    """A quarter of the default size (B = 512 prompts, M = 256 roots, N = 2: 512 units), the
    default shape (beta:0.4,0.4, turns 2–6) and 4 seeds × 4 iterations (figures: iterations
    2–4). The defaults (B = 2048, M = 1024, 3 × 4) give trace 58.78, grpo 6.94, oracle 67.43
    mixed/100u.

    Measured here: grpo 7.32 ± 0.36, trace 58.72 ± 2.15, oracle 68.26 ± 0.64 (mean ± std over
    the 4 seeds), so trace ÷ grpo = 8.0 (asserted ≥ 2) and trace ÷ oracle = 0.860 (asserted
    ≥ 0.80). Seed by seed (seeds 0–9 at this size, one at a time): trace ÷ oracle 0.811–0.932,
    trace ÷ grpo 7.7–9.2; a mean over 4 seeds moves by about 0.02 (std 0.036 / √4), so the
    0.80 line is some 3 of those below where the seeds put it. At B = 256, M = 128 the seeds
    spread twice as wide (0.777–0.990), too close to the line.
    """
    config = AllocationBenchConfig(
        prompts=512, budget=256, seeds=4, iterations=4, strategies=("grpo", "trace", "oracle")
    )
    result = run_allocation_bench(config)
    mixed = {name: m["mixed_per_100_units"].mean for name, m in result.strategies.items()}
    for name, metrics in result.strategies.items():
        # Equal budget: M(1 + N/2) = 256 × (1 + 2/2) = 512 units on every seed.
        assert (metrics["units"].mean, metrics["units"].std) == (512.0, 0.0), name
    assert mixed["trace"] >= 2 * mixed["grpo"], mixed
    assert mixed["trace"] >= 0.8 * mixed["oracle"], mixed
