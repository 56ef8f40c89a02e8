"""A minimal functional Qwen3 forward pass over an explicit KV cache, for ``TorchEngine``.

Reads the weights of an HF ``Qwen3ForCausalLM`` once and runs the same arithmetic as
transformers' implementation, without its per-call machinery (mask builders, cache objects,
output dataclasses, per-step cache concatenation), which for a small model at a small batch
costs more than the arithmetic:

    x = embed(tokens)                                            # (B, T, C)
    for each layer:
        h = rms_norm(x)
        q, k, v = h @ Wq, h @ Wk, h @ Wv                         # per-head RMSNorm on q and k
        q, k = rope(q), rope(k)                                  # positions from the caller
        cache[:, :, positions] = k, v                            # write, then attend
        x = x + attn(q, cache[:, :, :Tk]) @ Wo                   # GQA, causal by position
        x = x + down(silu(gate(rms_norm(x))) * up(rms_norm(x)))
    logits = rms_norm(x) @ lm_head                               # tied or untied

The cache layout is one row per sequence and **column = position**: token ``t`` of row ``b``
at position ``p`` writes its key and value to ``cache[:, b, :, p]``, and a query at position
``p`` attends to columns ``0..p`` of its row. Rows of different lengths therefore batch
together without padding on the left: a shorter row simply stops earlier, and whatever lies
in its later columns is never attended before it is overwritten. The caller keeps every
column ``< p`` of a row filled with that row's real keys and values.

Scope: full attention with the default RoPE and SiLU MLP (every Qwen3 dense checkpoint).
Sliding-window layers, scaled RoPE variants and attention biases are refused, not silently
run wrong. The weights are a snapshot: read them again after the HF model changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class Qwen3Spec:
    """The dimensions a forward pass needs, read from an HF ``Qwen3Config``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> Qwen3Spec:
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if rope_type != "default" or theta is None:
            raise NotImplementedError(f"only default RoPE is implemented, got {rope!r}")
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        if getattr(config, "use_sliding_window", False) or set(layer_types) != {"full_attention"}:
            raise NotImplementedError("sliding-window attention layers are not implemented")
        if getattr(config, "attention_bias", False):
            raise NotImplementedError("attention biases are not implemented")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"only the SiLU MLP is implemented, got {config.hidden_act}")
        head_dim = getattr(config, "head_dim", None)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_positions=config.max_position_embeddings,
        )


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (C,)
    qkv: torch.Tensor  # ((H + 2·Hkv)·D, C): q, k and v projections stacked, one matmul
    qk_norm: torch.Tensor  # (H + Hkv, D): q_norm for each query head, then k_norm for each kv head
    o: torch.Tensor  # (C, H·D)
    mlp_norm: torch.Tensor  # (C,)
    gate_up: torch.Tensor  # (2·I, C): gate and up projections stacked
    down: torch.Tensor  # (C, I)


@dataclass(frozen=True)
class Qwen3Weights:
    spec: Qwen3Spec
    embed: torch.Tensor  # (V, C)
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # (C,)
    lm_head: torch.Tensor  # (V, C); the embedding itself when tied
    rope: torch.Tensor  # (max_positions, 2·D): cos then sin of each position's angles

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def from_model(
        cls, model: PreTrainedModel, device: str | torch.device | None = None
    ) -> Qwen3Weights:
        """A copy of an HF ``Qwen3ForCausalLM``'s weights (in its dtype) on ``device``.

        A copy, not views: later optimizer steps on the model do not leak into the snapshot
        (half of which would be stale anyway, the stacked projections being new tensors).
        """
        dev = torch.device(device) if device is not None else model.device
        state = {k: v.detach().to(dev, copy=True) for k, v in model.state_dict().items()}
        return cls.from_state_dict(state, model.config)

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, torch.Tensor], config: PretrainedConfig
    ) -> Qwen3Weights:
        spec = Qwen3Spec.from_config(config)
        with torch.no_grad():
            layers = []
            for i in range(spec.num_layers):
                p = f"model.layers.{i}."
                attn = p + "self_attn."
                layers.append(
                    LayerWeights(
                        attn_norm=state[p + "input_layernorm.weight"],
                        qkv=torch.cat([state[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")]),
                        qk_norm=torch.cat(
                            [
                                state[attn + "q_norm.weight"].expand(spec.num_heads, -1),
                                state[attn + "k_norm.weight"].expand(spec.num_kv_heads, -1),
                            ]
                        ),
                        o=state[attn + "o_proj.weight"],
                        mlp_norm=state[p + "post_attention_layernorm.weight"],
                        gate_up=torch.cat(
                            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
                        ),
                        down=state[p + "mlp.down_proj.weight"],
                    )
                )
            embed = state["model.embed_tokens.weight"]
            tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state
            return cls(
                spec=spec,
                embed=embed,
                layers=tuple(layers),
                norm=state["model.norm.weight"],
                lm_head=embed if tied else state["lm_head.weight"],
                rope=rope_table(spec, embed.device, embed.dtype),
            )


def rope_table(spec: Qwen3Spec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin for every position side by side, (max_positions, 2·D), as HF computes them.

    The inverse frequencies are made on the CPU in float32 (as HF's buffer is) and the
    angles in float32, so the tables match HF's bit for bit before the cast to ``dtype``.
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    positions = torch.arange(spec.max_positions, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    return torch.cat((emb.cos(), emb.sin()), dim=-1).to(dtype)


@dataclass(frozen=True)
class KVCache:
    """Keys and values for a batch of rows; column = position (see the module docstring).

    Kept contiguous: ``forward`` writes through a flat ``(rows · heads · columns, D)`` view.
    """

    k: torch.Tensor  # (L, B, Hkv, T, D)
    v: torch.Tensor  # (L, B, Hkv, T, D)

    @classmethod
    def zeros(cls, weights: Qwen3Weights, batch: int, length: int) -> KVCache:
        # Zeros, not empty: a stale NaN in a masked column would still poison the softmax.
        s = weights.spec
        shape = (s.num_layers, batch, s.num_kv_heads, length, s.head_dim)
        dev, dtype = weights.device, weights.dtype
        return cls(
            torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype)
        )

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF: normalise in float32, cast back, then scale (the order matters in bf16).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D), cos and sin (B, T, 1, D): rotate pairs (i, i + D/2) by the angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def forward(
    weights: Qwen3Weights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache,
    span: int | None = None,
) -> torch.Tensor:
    """Run ``tokens`` (B, T) at ``positions`` (B, T) through the layers; final-normed (B, T, C).

    Row ``b`` of the batch is row ``b`` of ``cache``; keys and values are written at their
    positions before attention, so the caller only provides earlier columns. ``span`` is
    ``max(positions) + 1`` when the caller knows it (saves a device sync); columns at or past
    it are neither read nor written.
    """
    s = weights.spec
    B, T = tokens.shape
    H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
    Tk = span if span is not None else int(positions.max()) + 1  # columns some query sees
    dev = tokens.device
    angle = positions
    if Tk > weights.rope.shape[0]:  # only padding queries sit past the last position
        angle = positions.clamp(max=weights.rope.shape[0] - 1)
    cos, sin = F.embedding(angle, weights.rope).unsqueeze(2).chunk(2, dim=-1)  # (B, T, 1, D)
    # Where each new key goes in a layer's cache viewed as rows of D: (b, h, position).
    rows = torch.arange(B, device=dev)[:, None, None] * Hkv + torch.arange(Hkv, device=dev)
    dest = (rows * cache.length + positions[:, :, None]).flatten()  # (B·T·Hkv,)
    visible = torch.arange(Tk, device=dev) <= positions[:, :, None]  # (B, T, Tk)
    attend = _attend_one if T == 1 and tokens.device.type == "cpu" else _attend_sdpa
    bias = _mask_bias(visible, Hkv, weights.dtype) if attend is _attend_one else visible

    x = F.embedding(tokens, weights.embed)  # (B, T, C)
    for layer, w in enumerate(weights.layers):
        h = rms_norm(x, w.attn_norm, s.rms_norm_eps)
        qkv = F.linear(h, w.qkv)  # (B, T, (H + 2·Hkv)·D)
        # q and k are adjacent: one per-head RMSNorm and one rotation serve both.
        qk = qkv[..., : (H + Hkv) * D].view(B, T, H + Hkv, D)
        qk = apply_rope(rms_norm(qk, w.qk_norm, s.rms_norm_eps), cos, sin)
        cache.k[layer].view(-1, D).index_copy_(0, dest, qk[:, :, H:].reshape(-1, D))
        cache.v[layer].view(-1, D).index_copy_(0, dest, qkv[..., (H + Hkv) * D :].reshape(-1, D))
        att = attend(qk[:, :, :H], cache.k[layer, :, :, :Tk], cache.v[layer, :, :, :Tk], bias)
        x = x + F.linear(att, w.o)  # att (B, T, H·D)
        h = rms_norm(x, w.mlp_norm, s.rms_norm_eps)
        gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, w.down)
    return rms_norm(x, weights.norm, s.rms_norm_eps)


def _attend_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """q (B, T, H, D), k and v (B, Hkv, Tk, D), visible (B, T, Tk) bool -> (B, T, H·D)."""
    B, T, H, D = q.shape
    att = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (B, H, T, D)
        k,
        v,
        attn_mask=visible.unsqueeze(1),  # (B, 1, T, Tk)
        enable_gqa=k.shape[1] != H,
    )  # (B, H, T, D)
    return att.transpose(1, 2).reshape(B, T, H * D)


def _mask_bias(visible: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, Tk) bool -> (B·Hkv, 1, Tk) additive mask: 0 where visible, -inf elsewhere."""
    B, _, Tk = visible.shape
    bias = torch.zeros((B, 1, Tk), dtype=dtype, device=visible.device)
    bias = bias.masked_fill_(~visible, float("-inf"))
    return bias.repeat_interleave(kv_heads, dim=0)


def _attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """One query per row (decode) on the CPU: q (B, 1, H, D) -> (B, 1, H·D).

    Two batched matmuls instead of SDPA: the CPU SDPA kernel tiles over queries and with a
    single query spends most of its time in per-row setup (≈2× slower at 64 rows here). The
    query heads sharing a kv head are the rows of one matmul, which is grouped-query attention
    without repeating k and v.
    """
    B, _, H, D = q.shape
    Hkv = k.shape[1]
    q3 = q.reshape(B * Hkv, H // Hkv, D)  # heads of a group are adjacent, as in HF
    scores = torch.baddbmm(bias, q3, k.flatten(0, 1).transpose(1, 2), alpha=D**-0.5)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)  # (B·Hkv, G, Tk)
    return torch.bmm(probs, v.flatten(0, 1)).view(B, 1, H * D)


def lm_logits(weights: Qwen3Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states (..., C) to float32 logits (..., V)."""
    return F.linear(hidden, weights.lm_head).float()
