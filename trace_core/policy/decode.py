"""TorchEngine's decode step: one token per row of a running batch, through
``decoder.DecoderWeights`` over a ``decoder.KVCache``'s views (``DecodeViews``), then the
next token per row (``sample_step``).

``decode_step`` is the arithmetic of ``decoder.forward`` at one token per row in fewer
kernels. On a CPU both run compiled (``decode_step.cpp``, built and loaded by
``policy.native``): the same ATen calls from C++, equal bit for bit, without Python's cost
per operation, which on a small policy outweighs the arithmetic; elsewhere, or where it
cannot be built, ``_decode_step_python`` and ``_sample_step_python`` run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trace_core.policy import native
from trace_core.policy.decoder import DecoderWeights, KVCache, apply_rope, lm_logits, normalize
from trace_core.policy.sampling import TableDraws, sample

UPSTREAM = (
    "torch.nn.functional.embedding(input, weight, /)",
    "torch.nn.functional.silu",
    # torch.mm, torch.addmm, torch.baddbmm, torch.bmm and torch.cat are bound by a loop over
    # torch._C in torch/__init__.py, which the static check cannot follow: not listed.
)
"""What the Python step calls in torch (``policy.upstream``: entry syntax there)."""


@dataclass(frozen=True)
class DecodeViews:
    """A ``KVCache``'s views that a decode step reads, per layer, made once for a batch's
    layout rather than sliced out again in every layer of every step (a small model's step
    is mostly such per-call costs).

    ``rows``: the layer as (2·B·Hkv·T, D) rows, written through ``kv_rows`` indices;
    ``keys``: (B·Hkv, D, T), keys transposed for the scores' batched matmul; ``values``:
    (B·Hkv, T, D).
    """

    rows: tuple[torch.Tensor, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, cache: KVCache) -> DecodeViews:
        D = cache.kv.shape[-1]
        layers = range(cache.kv.shape[0])
        return cls(
            rows=tuple(cache.kv[i].view(-1, D) for i in layers),
            keys=tuple(cache.kv[i, 0].flatten(0, 1).transpose(1, 2) for i in layers),
            values=tuple(cache.kv[i, 1].flatten(0, 1) for i in layers),
        )


def decode_step(
    weights: DecoderWeights,
    tokens: torch.Tensor,
    dest: torch.Tensor,
    rope: torch.Tensor,
    views: DecodeViews,
    mask: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """One token per row: ``tokens`` (B,) -> normalised hidden states (B, C).

    On a CPU, the compiled step (``policy.native``: the same operations from C++, results
    equal bit for bit) when it is built; otherwise, and on other devices, the Python one.
    """
    step = native.decode_step() if tokens.device.type == "cpu" else None
    if step is None:
        return _decode_step_python(weights, tokens, dest, rope, views, mask, span)
    s = weights.spec
    return step(
        weights.embed,
        *weights.stacked,
        views.rows,
        views.keys,
        views.values,
        tokens,
        dest,
        rope,
        mask,
        span,
        s.num_heads,
        s.num_kv_heads,
        s.head_dim,
        s.head_dim**-0.5,
        s.rms_norm_eps,
    )


def _decode_step_python(
    weights: DecoderWeights,
    tokens: torch.Tensor,
    dest: torch.Tensor,
    rope: torch.Tensor,
    views: DecodeViews,
    mask: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """``decode_step`` in Python; ``decode_step.cpp`` makes the same calls.

    ``dest`` (2·B·Hkv,) is where each row's new key and value go (``kv_rows`` at the rows'
    positions) and ``rope`` (B, 2·D) its position's row of the rope table; ``views``: the
    batch's ``KVCache`` (``DecodeViews.of``).
    ``mask`` (B·Hkv, 1, T) is the additive attention mask (0 visible, -inf not), kept by the
    caller across steps: this step makes the new column visible in it. Only the first
    ``span`` columns are read. The arithmetic of ``forward`` in fewer kernels: no index
    tensors derived from positions, the mask updated rather than rebuilt, 2-D matmuls with the
    residual adds fused in (``addmm``), attention as two batched matmuls (``_attend_one``)
    on views made once.
    """
    s = weights.spec
    B = tokens.shape[0]
    H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
    scale, dtype = D**-0.5, weights.dtype
    eps = torch.full((1, 1), s.rms_norm_eps, dtype=torch.float32, device=tokens.device)
    mask.view(-1).index_fill_(0, dest[: B * Hkv], 0.0)  # key rows: (b·Hkv + h)·T + position
    cos, sin = rope.unsqueeze(1).chunk(2, dim=-1)  # (B, 1, D)
    visible = mask[:, :, :span]
    x = F.embedding(tokens, weights.embed)  # (B, C)
    for w, rows, keys, values in zip(
        weights.layers, views.rows, views.keys, views.values, strict=True
    ):
        qkv = torch.mm(normalize(x, eps), w.qkv)  # (B, (H + 2·Hkv)·D)
        qk = qkv[:, : (H + Hkv) * D].view(B, H + Hkv, D)
        if w.qk_norm is not None:
            qk = normalize(qk, eps) * w.qk_norm
        qk = apply_rope(qk, cos, sin)
        new_kv = torch.cat((qk[:, H:], qkv[:, (H + Hkv) * D :].view(B, Hkv, D)))  # (2·B, Hkv, D)
        rows.index_copy_(0, dest, new_kv.view(-1, D))
        # _attend_one's arithmetic on the views: the heads of a group are one matmul's rows.
        q = qk[:, :H].reshape(B * Hkv, H // Hkv, D)
        scores = torch.baddbmm(visible, q, keys[:, :, :span], alpha=scale)
        probs = scores.softmax(dim=-1, dtype=torch.float32)  # (B·Hkv, G, span)
        if probs.dtype != dtype:
            probs = probs.to(dtype)
        x = torch.addmm(x, torch.bmm(probs, values[:, :span]).view(B, H * D), w.o)
        gate, up = torch.mm(normalize(x, eps), w.gate_up).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate).mul_(up), w.down)
    return normalize(x, eps)


@dataclass(frozen=True)
class Draws:
    """What ``sample_step`` draws a running batch's next tokens with, and where it writes
    them: each row's uniforms by step (``sampling.keyed_table``), the rows' steps (moved on by
    one, in place), their output tokens and logprobs by step, and the batch's sampling."""

    table: torch.Tensor  # (B, W) float64
    steps: torch.Tensor  # (B,) int64
    tokens: torch.Tensor  # (B, W') int64
    logprobs: torch.Tensor  # (B, W') float32
    temperature: float
    top_p: float


def sample_step(weights: DecoderWeights, hidden: torch.Tensor, draws: Draws) -> torch.Tensor:
    """The head's logits for ``hidden`` (B, C) and one token per row, drawn with the row's
    uniform for its step in ``draws.table`` (``sampling.TableDraws``); each token and its
    logprob go to column ``steps`` of ``draws.tokens`` and ``draws.logprobs`` (their last
    column for a row past it), and ``draws.steps`` moves on by one, in place. The tokens (B,).

    Compiled on a CPU, as ``decode_step``.
    """
    op = native.sample_step() if hidden.device.type == "cpu" else None
    if op is None:
        return _sample_step_python(weights, hidden, draws)
    d = draws
    return op(
        hidden, weights.lm_head, d.table, d.steps, d.tokens, d.logprobs, d.temperature, d.top_p
    )


def _sample_step_python(
    weights: DecoderWeights, hidden: torch.Tensor, draws: Draws
) -> torch.Tensor:
    """``sample_step`` in Python; ``decode_step.cpp`` makes the same calls."""
    d = draws
    picked = sample(
        lm_logits(weights, hidden), d.temperature, d.top_p, TableDraws(d.table, d.steps)
    )
    column = d.steps.clamp(max=d.tokens.shape[1] - 1)[:, None]  # idle rows too
    d.tokens.scatter_(1, column, picked.tokens[:, None])
    d.logprobs.scatter_(1, column, picked.logprobs[:, None])
    d.steps.add_(1)  # in place: the batch holds this tensor
    return picked.tokens
