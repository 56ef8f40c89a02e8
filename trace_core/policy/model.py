"""The policy network: a tiny Qwen3 for CPU runs, and checkpoints any HF causal LM can use.

The tiny policy is a real ``Qwen3ForCausalLM`` with small dimensions (≈370k parameters with a
300-token vocabulary), so everything that runs on it (SFT, RL updates, ``TorchEngine``, HF
``generate``, vLLM) runs unchanged on a real Qwen3 checkpoint. Checkpoints are plain HF
directories (``config.json``, ``model.safetensors``, tokenizer files); nothing is pickled.

    model = create_policy(tokenizer, TinyPolicyConfig(), seed=0)
    save_checkpoint(model, tokenizer, "ckpt/")
    model, tokenizer = load_checkpoint("ckpt/")          # or any HF causal-LM directory
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from trace_core.policy.checkpoint import CheckpointError, check_checkpoint, load_tokenizer


@dataclass(frozen=True)
class TinyPolicyConfig:
    """Dimensions of the tiny Qwen3 policy; the vocabulary size comes from the tokenizer."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    """Fewer than ``num_heads`` gives grouped-query attention, as in real Qwen3 models."""
    head_dim: int = 64
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    max_positions: int = 4096
    """Longest rollout (prompt + all turns) in tokens."""
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.intermediate_size < 1 or self.max_positions < 1:
            raise ValueError("intermediate_size and max_positions must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")


def create_policy(
    tokenizer: PreTrainedTokenizerBase, config: TinyPolicyConfig, seed: int
) -> Qwen3ForCausalLM:
    """A randomly initialised tiny Qwen3 (float32, eval mode) sized for ``tokenizer``.

    HF initialises weights from torch's global generator; we fork it, so ``seed`` decides the
    weights and the caller's global random state is left as it was.
    """
    hf_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(hf_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.eval()
    return model


def save_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> None:
    """Write an HF directory: ``config.json``, ``model.safetensors`` and the tokenizer files."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)  # transformers 5 writes safetensors only
    tokenizer.save_pretrained(path)


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any HF causal-LM directory (ours or a downloaded Qwen3) in eval mode on ``device``.

    Only safetensors weights are read; a directory holding only pickled weights is refused.
    The folder is checked first (``policy.checkpoint``): what is missing or damaged is named.
    """
    folder = check_checkpoint(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, use_safetensors=True, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{folder}: the model does not load ({err})") from None
    tokenizer = load_tokenizer(folder)
    torch.nn.Module.to(model, torch.device(device))  # in place, as for any module
    model.eval()
    return model, tokenizer


def resolve_device(name: str = "auto") -> str:
    """``auto`` is CUDA when this process has a GPU (a GPU pod, a Ray GPU actor), else the CPU.
    Not yet validated on CUDA: the engine and the update are written device-agnostic and
    exercised on CPU, where results are bit-exact run to run."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name
