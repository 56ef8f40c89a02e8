"""The policy network: a tiny Qwen3 for CPU runs, and checkpoints any HF causal LM can use.

The tiny policy is a real ``Qwen3ForCausalLM`` with small dimensions (≈370k parameters with a
300-token vocabulary), so everything that runs on it (SFT, RL updates, ``TorchEngine``, HF
``generate``, vLLM) runs unchanged on a real Qwen3 checkpoint. Checkpoints are plain HF
directories (``config.json``, ``model.safetensors``, tokenizer files); nothing is pickled.

    model = create_policy(tokenizer, TinyPolicyConfig(), seed=0)
    save_checkpoint(model, tokenizer, "ckpt/")
    model, tokenizer = load_checkpoint("ckpt/")          # or any HF causal-LM directory

**Dtypes.** A checkpoint keeps the dtype it is served in (``checkpoint_dtype``: bfloat16 for
Qwen3 or Llama, float32 for the tiny policy); engines load it as it is. A trainer loads it in
float32 whatever it holds (``load_for_training``): fp32 master weights and fp32 AdamW moments,
with bf16 only in the arithmetic (autocast on GPUs, ``policy.update``); at a learning rate of
1e-6 an update applied to bf16 weights (8 bits of mantissa) would round almost every element
away. What the trainer writes for the engines is cast back to the serving dtype
(``save_checkpoint(..., dtype=serving)``), so engines and the stored copy stay half the size.
The fp32 master weights then travel beside the optimizer state (``save_master``, only when
the serving dtype is not float32), so the next update goes on from them, not from the rounded
copy: updates smaller than half a bf16 step would otherwise be lost at every iteration.
"""

from __future__ import annotations

import json
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

UPSTREAM = (
    # The auto class passes its keywords on to the model class's from_pretrained.
    "transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, /)",
    "transformers.PreTrainedModel.from_pretrained(use_safetensors, local_files_only, dtype)",
    "transformers.PreTrainedModel.save_pretrained(save_directory, /, state_dict)",
    "transformers.PreTrainedModel.generation_config",
    "transformers.PreTrainedModel.dtype",
    "transformers.PreTrainedTokenizerBase.save_pretrained(save_directory, /)",
    "transformers.GenerationConfig.pad_token_id",
    "transformers.GenerationConfig.eos_token_id",
    "transformers.Qwen3Config(vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
    "num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings, "
    "rope_parameters, tie_word_embeddings, pad_token_id, eos_token_id, bos_token_id)",
    "transformers.Qwen3ForCausalLM(config, /)",
    "torch.random.fork_rng(devices)",
    "torch.nn.Module.to",
    "safetensors.torch.save_model(model, filename, /)",
    "safetensors.torch.load_model(model, filename, /, strict)",
)
"""What this module calls in transformers, torch and safetensors (``policy.upstream``: entry
syntax there)."""


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
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Write an HF directory: ``config.json``, ``model.safetensors`` and the tokenizer files.

    ``dtype``: the floating-point weights are written in it and ``config.json`` records it (a
    trainer's fp32 master weights saved in the serving dtype); None: as the model holds them.
    """
    Path(path).mkdir(parents=True, exist_ok=True)
    if dtype is None or dtype == model.dtype:
        model.save_pretrained(path)  # transformers 5 writes safetensors only
    else:
        weights = {
            name: value.to(dtype) if value.is_floating_point() else value
            for name, value in model.state_dict().items()
        }
        model.save_pretrained(path, state_dict=weights)
        # save_pretrained records the parameters' dtype; the file holds ``dtype``.
        config = json.loads((Path(path) / "config.json").read_text())
        config["dtype"] = dtype_name(dtype)
        (Path(path) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(path)


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any HF causal-LM directory (ours or a downloaded Qwen3) in eval mode on ``device``.

    ``dtype``: the parameters' dtype (float32 for a trainer: ``load_for_training``); None: the
    checkpoint's own (``checkpoint_dtype``), what an engine serves. Only safetensors weights
    are read; a directory holding only pickled weights is refused. The folder is checked first
    (``policy.checkpoint``): what is missing or damaged is named.
    """
    folder = check_checkpoint(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            use_safetensors=True,
            local_files_only=True,
            dtype=dtype or checkpoint_dtype(folder),
        )
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{folder}: the model does not load ({err})") from None
    tokenizer = load_tokenizer(folder)
    torch.nn.Module.to(model, torch.device(device))  # in place, as for any module
    model.eval()
    return model, tokenizer


def load_for_training(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.dtype]:
    """A trainer's copy of a checkpoint: float32 parameters (the master weights the optimizer
    steps), the tokenizer, and the dtype the checkpoint is served in, to write updates back in
    (``save_checkpoint(..., dtype=serving)``)."""
    serving = checkpoint_dtype(path)
    model, tokenizer = load_checkpoint(path, device, dtype=torch.float32)
    return model, tokenizer, serving


FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The weight dtypes a checkpoint may be stored in (the names ``config.json`` uses)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: how ``config.json`` and the update's record say it."""
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype a checkpoint's weights are stored and served in: ``config.json``'s ``dtype``
    (``torch_dtype`` in files written before transformers 5), float32 when it names none."""
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: dtype {name!r} is not one of {', '.join(FLOAT_DTYPES)}"
        )
    return FLOAT_DTYPES[name]


def resolve_device(name: str = "auto") -> str:
    """``auto`` is CUDA when this process has a GPU (a GPU pod, a Ray GPU actor), else the CPU.
    Not yet validated on CUDA: the engine and the update are written device-agnostic and
    exercised on CPU, where results are bit-exact run to run."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


MASTER = "master.safetensors"
"""The trainer's float32 weights, beside the optimizer state, when the policy is served in
another dtype (``save_master``)."""


def save_master(model: PreTrainedModel, folder: str | Path, serving: torch.dtype) -> None:
    """Write ``model``'s float32 weights to ``folder/master.safetensors`` when the checkpoint
    for the engines holds a rounded copy (``serving`` is not float32); nothing otherwise."""
    if serving == torch.float32:
        return
    from safetensors.torch import save_model

    Path(folder).mkdir(parents=True, exist_ok=True)
    save_model(model, str(Path(folder) / MASTER))  # shared (tied) tensors written once


def load_master(model: PreTrainedModel, folder: str | Path | None) -> bool:
    """Put ``folder/master.safetensors`` (``save_master``) into ``model``'s float32 parameters
    if the file is there; whether it was."""
    if folder is None or not (Path(folder) / MASTER).is_file():
        return False
    from safetensors.torch import load_model

    path = Path(folder) / MASTER
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except RuntimeError as err:  # shapes that differ
        first = str(err).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{path}: not this policy's master weights ({first})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: not this policy's master weights (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    return True
