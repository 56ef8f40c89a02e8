"""How much memory one policy update needs: an estimate from the model's shape, for sizing GPUs
before renting them (``trace-rl model check``, ``trace-rl bench update``). Importable without
torch.

The update (``policy.update``) keeps fp32 master weights, their gradients and AdamW's two
moments (16 bytes per parameter); on CUDA, bf16 autocast adds a bf16 copy of the weights it
casts (2 bytes per parameter). Activations scale with the tokens of one micro-batch: per token
and layer the tensors autograd keeps (norm inputs and outputs, q/k/v before and after RoPE,
the attention output, the MLP's gate, up and their product) are about
``4·C + 2·q + 3·kv + 4·I`` values, in bf16 on CUDA and fp32 on CPU; with gradient
checkpointing only each layer's fp32 input is kept, plus one layer's activations during its
recomputation. The vocabulary head holds one ``logit_chunk`` of fp32 logits (three copies:
logits, log-softmax, gradient). Attention is SDPA's memory-efficient kernel: nothing
quadratic in the sequence length is kept.

An estimate: allocator slack, the CUDA context and framework buffers are not in it.
``trace-rl bench update`` prints it beside the measured peak for the model at hand.

    estimate_update(QWEN3["8B"], micro_tokens=8192, checkpointing=True, device="cuda").total
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder (HF config names in the comments)."""

    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    tied: bool  # tie_word_embeddings

    @property
    def parameters(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate
        per_layer += 2 * self.hidden  # the two RMSNorm weights
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden + head + self.hidden

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """From an HF config object (``config.json``'s fields)."""
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)  # type: ignore[attr-defined]
        return cls(
            layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate=int(config.intermediate_size),  # type: ignore[attr-defined]
            vocab=int(config.vocab_size),  # type: ignore[attr-defined]
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )


QWEN3 = {
    "1.7B": ModelShape(28, 2048, 16, 8, 128, 6144, 151_936, tied=True),
    "8B": ModelShape(36, 4096, 32, 8, 128, 12288, 151_936, tied=False),
    "14B": ModelShape(40, 5120, 40, 8, 128, 17408, 151_936, tied=False),
}
"""The published Qwen3 dense shapes the paper trains (and 1.7B, its smallest useful sibling)."""


@dataclass(frozen=True)
class UpdateMemory:
    """Bytes of one update's peak, by what holds them."""

    weights: int  # fp32 master weights
    gradients: int
    optimizer: int  # AdamW's two moments
    cast: int  # bf16 copies of the weights under autocast (CUDA)
    activations: int
    head: int  # one chunk of vocabulary logits

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.cast
            + self.activations
            + self.head
        )

    def to_json(self) -> dict[str, float]:
        return {k: v / GIB for k, v in {**asdict(self), "total": self.total}.items()}


def estimate_update(
    shape: ModelShape,
    micro_tokens: int,
    checkpointing: bool,
    device: str = "cuda",
    logit_chunk: int = 512,
) -> UpdateMemory:
    """The estimated peak of one update whose passes hold ``micro_tokens`` tokens."""
    if micro_tokens < 1:
        raise ValueError(f"micro_tokens must be >= 1, got {micro_tokens}")
    p = shape.parameters
    act_bytes = 2 if device == "cuda" else 4
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = micro_tokens * (4 * shape.hidden + 2 * q + 3 * kv + 4 * shape.intermediate)
    if checkpointing:
        kept = shape.layers * micro_tokens * shape.hidden * 4 + per_layer * act_bytes
    else:
        kept = shape.layers * per_layer * act_bytes
    return UpdateMemory(
        weights=4 * p,
        gradients=4 * p,
        optimizer=8 * p,
        cast=2 * p if device == "cuda" else 0,
        activations=kept + micro_tokens * shape.hidden * 4,  # + the final hidden states
        head=3 * min(logit_chunk, micro_tokens) * shape.vocab * 4,
    )
