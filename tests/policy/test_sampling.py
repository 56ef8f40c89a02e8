"""sample_tokens and sample: frequencies against probabilities worked out by hand, greedy at
temperature 0, and the logprobs sample reports."""

from __future__ import annotations

import numpy as np
import torch

from trace_core.policy.sampling import sample, sample_tokens


def test_sample_tokens_worked_example() -> None:
    """p = [0.5, 0.3, 0.15, 0.05]; top_p = 0.7 keeps tokens 0 and 1 (the mass before token 2
    is 0.8 >= 0.7), renormalised to 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(40_000, 4)
    gen = torch.Generator().manual_seed(0)
    full = np.bincount(sample_tokens(logits, 1.0, 1.0, gen).numpy(), minlength=4) / 40_000
    np.testing.assert_allclose(full, [0.5, 0.3, 0.15, 0.05], atol=0.012)  # ~5 sigma
    top = np.bincount(sample_tokens(logits, 1.0, 0.7, gen).numpy(), minlength=4) / 40_000
    np.testing.assert_allclose(top, [0.625, 0.375, 0, 0], atol=0.012)
    # Temperature 0.5 squares the probabilities: [0.25, 0.09, 0.0225, 0.0025] / 0.365.
    cold = np.bincount(sample_tokens(logits, 0.5, 1.0, gen).numpy(), minlength=4) / 40_000
    np.testing.assert_allclose(cold, np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365, atol=0.012)
    assert sample_tokens(logits[:2], 0.0, 1.0, None).tolist() == [0, 0]


def test_sample_reports_temperature_one_logprobs() -> None:
    """sample draws as sample_tokens does and reports log p at temperature 1 before top-p.
    p = [0.5, 0.3, 0.15, 0.05] at temperature 0.8 is p^1.25 / 0.759 = [0.553, 0.292, 0.123,
    0.032]; top_p = 0.7 keeps tokens 0 and 1 (mass before token 2: 0.845), whose reported
    logprobs are log 0.5 and log 0.3, not those of the tempered, renormalised draw."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(40_000, 4)
    gen = torch.Generator().manual_seed(1)
    full = sample(logits, 1.0, 1.0, gen)
    freq = np.bincount(full.tokens.numpy(), minlength=4) / 40_000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.012)
    top = sample(logits, 0.8, 0.7, gen)
    assert set(top.tokens.tolist()) == {0, 1}
    want = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[top.tokens]
    torch.testing.assert_close(top.logprobs, want)
    greedy = sample(logits[:2], 0.0, 1.0, None)
    assert greedy.tokens.tolist() == [0, 0]
    torch.testing.assert_close(greedy.logprobs, torch.tensor([0.5, 0.5]).log())
