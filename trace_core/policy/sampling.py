"""Next-token sampling from a batch of logits: temperature, top-p, then one uniform draw per row.

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``; temperature 0
is greedy. Randomness comes only from the ``torch.Generator`` passed in.
"""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) -> (B,); greedy when ``temperature`` is 0.

    Inverse-CDF sampling: one uniform per row against the cumulative probabilities, in
    float64 so that the rounding edge ``u · total == total`` (which would pick the last
    token whatever its probability) has odds near 2⁻⁵³. ``torch.multinomial`` draws an
    exponential per vocabulary entry instead: ten times slower for a 64 × 300 batch here.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, V)
    u = torch.rand(
        (logits.shape[0], 1), generator=generator, device=logits.device, dtype=torch.float64
    )
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # (B, 1)
    picked = picked.clamp_(max=logits.shape[-1] - 1)
    if order is not None:
        picked = order.gather(-1, picked)
    return picked.squeeze(-1)
