"""sample_tokens and sample: frequencies against probabilities worked out by hand, greedy at
temperature 0, and the logprobs sample reports; keyed draws against a plain-integer reference
of their hash, uniform and a function of (key, step) only."""

from __future__ import annotations

import numpy as np
import torch

from trace_core.policy.sampling import (
    KeyedDraws,
    TableDraws,
    keyed_table,
    keyed_uniforms,
    request_keys,
    request_seed,
    sample,
    sample_tokens,
)


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


def reference_uniform(key: int, step: int) -> float:
    """``keyed_uniforms`` in Python integers (no wrapping, no tensors)."""
    m = 0xFFFFFFFF

    def mix(x: int) -> int:
        x ^= x >> 16
        x = x * 0x7FEB352D & m
        x ^= x >> 15
        x = x * 0x846CA68B & m
        return x ^ (x >> 16)

    a = mix((key & m) ^ mix((key >> 32) ^ mix(step & m)))
    b = mix(a ^ 0x9E3779B9)
    return ((a >> 6) * 2**27 + (b >> 5)) / 2**53


def test_keyed_uniforms_are_a_function_of_key_and_step_only() -> None:
    keys = request_keys([request_seed(3, i) for i in range(500)], 4)
    assert len(set(keys)) == 2000 and all(0 <= k < 2**63 for k in keys)
    for step in (0, 1, 77, 2**32 + 5):
        got = keyed_uniforms(torch.tensor(keys), step).squeeze(1).tolist()
        assert got == [reference_uniform(k, step) for k in keys]  # exact: no wrap lost a bit
    # A row draws the same whatever batch it is in, at whatever position.
    steps = torch.arange(len(keys)) % 9
    batch = keyed_uniforms(torch.tensor(keys), steps).squeeze(1)
    pairs = zip(keys[:50], steps[:50].tolist(), strict=True)
    alone = [keyed_uniforms(torch.tensor([k]), s).item() for k, s in pairs]
    assert batch[:50].tolist() == alone
    many = keyed_uniforms(torch.tensor(request_keys([11], 200_000)), 3).squeeze(1).numpy()
    assert many.min() >= 0 and many.max() < 1
    counts = np.bincount((many * 20).astype(int), minlength=20)
    assert np.abs(counts - 10_000).max() < 500  # 5 sigma of a binomial(200k, 1/20)


def test_keyed_draws_sample_the_worked_example() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(40_000, 4)
    draws = KeyedDraws(torch.tensor(request_keys([5], 40_000)), 0)
    freq = np.bincount(sample_tokens(logits, 1.0, 1.0, draws).numpy(), minlength=4) / 40_000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.012)
    head = KeyedDraws(draws.keys[:3], 0)  # the first three rows alone draw what they drew
    assert sample(logits[:3], 1.0, 1.0, head).tokens.tolist() == (
        sample_tokens(logits, 1.0, 1.0, draws)[:3].tolist()
    )


def test_a_keyed_table_draws_what_keyed_draws_draw() -> None:
    """A running batch reads each request's uniforms from a table made when it joins: the same
    numbers, bit for bit, as drawing them step by step, so the same tokens."""
    keys = torch.tensor(request_keys([request_seed(9, i) for i in range(37)], 2))
    table = keyed_table(keys, 64)
    for steps in (torch.zeros(74, dtype=torch.long), torch.arange(74) % 64):
        assert torch.equal(TableDraws(table, steps).uniforms(), KeyedDraws(keys, steps).uniforms())
    logits = torch.randn(74, 300, generator=torch.Generator().manual_seed(0))
    steps = torch.arange(74) % 64
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        table_pick = sample(logits, temperature, top_p, TableDraws(table, steps))
        keyed_pick = sample(logits, temperature, top_p, KeyedDraws(keys, steps))
        assert torch.equal(table_pick.tokens, keyed_pick.tokens)
