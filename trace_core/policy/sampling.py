"""Next-token sampling from a batch of logits: temperature, top-p, then one uniform draw per row.

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``; temperature 0
is greedy. ``sample`` also returns the log-probabilities the engine reports (temperature 1,
before top-p), reusing its ``log_softmax`` for the draw at temperature 1.

Randomness comes from what is passed in: a ``torch.Generator`` (one stream for the batch), or
``KeyedDraws``: each row's uniform is a hash of its request's key and how many tokens it has
sampled (``keyed_uniforms``), so a request samples the same tokens whatever else is in its
batch, whenever it joined it and on whichever engine it ran (up to float rounding in batched
kernels). Keys come from ``request_seed``: sample ``j`` of a request seeded ``s`` draws with
``request_seed(s, j)``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_M32 = 0xFFFFFFFF


def request_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (a run's seed, a prompt, a tree node, ...):
    equal parts give equal seeds, any change gives an unrelated one."""
    # The count goes first: SeedSequence pads with zeros, so (s,) and (s, 0) would agree.
    entropy = [len(parts), *(int(p) for p in parts)]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) | (int(state[1]) >> 1)


def prompt_seeds(seed: int | Sequence[int] | None, count: int) -> list[int]:
    """The seed of each of ``count`` prompts of a call: ``seed`` itself when it is one per
    prompt, ``request_seed(seed, i)`` for prompt ``i`` when it is one int, fresh ones when None."""
    if seed is None:
        seed = secrets.randbits(62)
    if isinstance(seed, int | np.integer):
        return [request_seed(int(seed), i) for i in range(count)]
    seeds = [int(s) for s in seed]
    if len(seeds) != count:
        raise ValueError(f"seed: {len(seeds)} seeds for {count} prompts (one per prompt)")
    if any(s < 0 for s in seeds):
        raise ValueError("seed: the seeds of a call must be non-negative")
    return seeds


def request_keys(seeds: Sequence[int], n: int) -> list[int]:
    """The key of every sample: ``n`` per request, sample ``j`` of request ``i`` at
    ``i * n + j``."""
    return [request_seed(s, j) for s in seeds for j in range(n)]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit
    values. A product may pass 2⁶³ and wrap; its low 32 bits, all that is kept, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def keyed_uniforms(keys: torch.Tensor, steps: torch.Tensor | int) -> torch.Tensor:
    """(B, 1) float64 uniforms in [0, 1), 53 random bits each, from each row's 63-bit key
    (B,) int64 and its step (a token's index in its sample): a pure function of the two."""
    step = torch.as_tensor(steps, dtype=torch.int64, device=keys.device) & _M32
    a = _mix32((keys & _M32) ^ _mix32((keys >> 32) ^ _mix32(step)))
    b = _mix32(a ^ 0x9E3779B9)
    bits = (a >> 6) * (1 << 27) + (b >> 5)  # 26 + 27 bits
    return (bits.to(torch.float64) * 2.0**-53).unsqueeze(-1)


@dataclass(frozen=True)
class KeyedDraws:
    """Per-row randomness: row ``r`` draws ``keyed_uniforms(keys[r], steps[r])``."""

    keys: torch.Tensor  # (B,) int64
    steps: torch.Tensor | int  # (B,) int64, or one step for every row

    def uniforms(self) -> torch.Tensor:
        return keyed_uniforms(self.keys, self.steps)


@dataclass(frozen=True)
class Sampled:
    tokens: torch.Tensor  # (B,) sampled token ids
    logprobs: torch.Tensor  # (B,) their log-probabilities at temperature 1, before top-p


def keyed_table(keys: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) float64: row ``r``'s ``keyed_uniforms`` for steps 0..width-1, computed in
    one pass (a running batch makes it once per request instead of once per step)."""
    steps = torch.arange(width, device=keys.device).repeat(keys.shape[0])
    return keyed_uniforms(keys.repeat_interleave(width), steps).view(keys.shape[0], width)


@dataclass(frozen=True)
class TableDraws:
    """``KeyedDraws`` read from a ``keyed_table``: row ``r`` draws ``table[r, steps[r]]``, the
    same uniform ``keyed_uniforms(keys[r], steps[r])`` gives. A step past the table's last
    column reads that column (a batch's finished rows, whose draws are thrown away)."""

    table: torch.Tensor  # (B, W) float64
    steps: torch.Tensor  # (B,) int64

    def uniforms(self) -> torch.Tensor:
        return self.table.gather(1, self.steps.clamp(max=self.table.shape[1] - 1)[:, None])


Draws = torch.Generator | KeyedDraws | TableDraws | None
"""Where a draw's uniforms come from: a generator, per-row keys, or torch's default generator."""


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: Draws,
) -> Sampled:
    """One token per row of ``logits`` (B, V), with its model log-probability."""
    logp = logits.log_softmax(dim=-1)  # (B, V)
    tokens = _draw(logits, logp, temperature, top_p, generator)
    return Sampled(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1))


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: Draws,
) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) -> (B,); greedy when ``temperature`` is 0."""
    return _draw(logits, None, temperature, top_p, generator)


def _draw(
    logits: torch.Tensor,
    logp: torch.Tensor | None,
    temperature: float,
    top_p: float,
    generator: Draws,
) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row against the cumulative probabilities, in
    float64 so that the rounding edge ``u · total == total`` (which would pick the last
    token whatever its probability) has odds near 2⁻⁵³. ``torch.multinomial`` draws an
    exponential per vocabulary entry instead: ten times slower for a 64 × 300 batch here.
    ``logp``, when given, is ``log_softmax(logits)``: at temperature 1 its exp is the softmax.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    if temperature == 1:
        probs = logp.exp() if logp is not None else logits.softmax(dim=-1)
    else:
        probs = (logits / temperature).softmax(dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, V)
    if isinstance(generator, KeyedDraws | TableDraws):
        u = generator.uniforms()
    else:
        u = torch.rand(
            (logits.shape[0], 1), generator=generator, device=logits.device, dtype=torch.float64
        )
    picked = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True)  # (B, 1)
    picked = picked.clamp_(max=logits.shape[-1] - 1)
    if order is not None:
        picked = order.gather(-1, picked)
    return picked.squeeze(-1)
