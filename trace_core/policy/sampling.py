"""Next-token sampling from a batch of logits: temperature, top-p, then one uniform draw per row.

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``; temperature 0
is greedy. Randomness comes only from the ``torch.Generator`` passed in. ``sample`` also returns
the log-probabilities the engine reports (temperature 1, before top-p), reusing its
``log_softmax`` for the draw at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampled:
    tokens: torch.Tensor  # (B,) sampled token ids
    logprobs: torch.Tensor  # (B,) their log-probabilities at temperature 1, before top-p


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> Sampled:
    """One token per row of ``logits`` (B, V), with its model log-probability."""
    logp = logits.log_softmax(dim=-1)  # (B, V)
    tokens = _draw(logits, logp, temperature, top_p, generator)
    return Sampled(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1))


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) -> (B,); greedy when ``temperature`` is 0."""
    return _draw(logits, None, temperature, top_p, generator)


def _draw(
    logits: torch.Tensor,
    logp: torch.Tensor | None,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
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
    u = torch.rand(
        (logits.shape[0], 1), generator=generator, device=logits.device, dtype=torch.float64
    )
    picked = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True)  # (B, 1)
    picked = picked.clamp_(max=logits.shape[-1] - 1)
    if order is not None:
        picked = order.gather(-1, picked)
    return picked.squeeze(-1)
