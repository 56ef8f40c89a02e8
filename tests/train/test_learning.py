"""Training improves the policy: on calc, from the default warm start, K TRACE iterations raise
held-out mean@k above the starting policy's. The one test in ``make test`` that checks the
learning itself, not its plumbing.

The warm start is the one ``trace-rl warmstart --task calc --threads 1 --output
tests/data/warmstart-calc`` makes (1,000 SFT steps, seed 0: four minutes on a core), stored
with its record; the run finds it in its folder and starts from it, as a rerun of a run does.
A change to the warm-start recipe (its steps, demonstrations, SFT or policy shape) makes the
run refuse the stored one, naming the difference: make it again with that command. The SFT
itself is tested in tests/train/test_warmstart.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trace_core.train.config import TrainConfig
from trace_core.train.loop import train

WARMSTART = Path(__file__).parents[1] / "data" / "warmstart-calc"


@pytest.mark.slow  # ≈ 1–2 min of RL and evaluation on an idle core
@pytest.mark.long
def test_trace_iterations_raise_held_out_mean_at_k(tmp_path: Path) -> None:
    """Warm start (1,000 SFT steps, seed 0), then 8 iterations of M = 128 roots × N = 2 over
    pools of 512 prompts, mean@4 on the first 90 eval tasks before and after.

    Measured from this warm start with RL seeds 0–3 (``train(TrainConfig(init=<warm start>,
    seed=s, eval_every=2, ...))``; seed 0 warm-started itself), every request drawing from a
    seed of its own, mean@4 start → after 8 iterations (the gain after 4 in brackets):
        seed 0: 0.372 → 0.550 (+0.178; +0.083)    seed 1: 0.347 → 0.478 (+0.131; +0.117)
        seed 2: 0.350 → 0.519 (+0.169; +0.111)    seed 3: 0.358 → 0.469 (+0.111; +0.086)
    mean gain +0.147, spread 0.111–0.178. The asserted margin, +0.05, is under half the
    smallest gain seen. Greedy pass@1 is not asserted: it fell on 3 of the 4 seeds (0.811 →
    0.800, 0.833 → 0.722, 0.833 → 0.822, 0.756 → 0.767) while mean@4 rose. The RL is cheap
    (≈ 6 s an iteration on an idle core); the warm start is the stored one (module
    docstring), the one this config makes, which took ≈ 6 min of this test before it was.
    Cheaper warm starts (≤ 800 steps, smaller policies or task subsets) gave gains between
    −0.044 and +0.031 (measured before per-request seeds): too close to zero to test.
    """
    config = TrainConfig(
        output=tmp_path / "run",
        warmstart_steps=1000,
        budget=128,
        prompts=512,
        iterations=8,
        eval_tasks=90,
        eval_k=4,
        eval_every=8,
        seed=0,
    )
    shutil.copytree(WARMSTART, config.output / "warmstart")
    records = train(config)
    start, final = records[0].eval, records[-1].eval
    assert start is not None and final is not None
    assert (records[0].iteration, records[-1].iteration) == (0, 8)
    gain = final["mean_k"]["all"] - start["mean_k"]["all"]  # type: ignore[index]
    assert gain >= 0.05, (start["mean_k"], final["mean_k"])
