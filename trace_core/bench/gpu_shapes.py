"""The GPU check's models and data: Qwen3 decoders of real shapes with random weights, and
synthetic rollout trees to update them on (``bench.gpu_check``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.policy.memory import ModelShape


@dataclass(frozen=True)
class Shape:
    """A Qwen3 decoder's dimensions."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    def model(self, seed: int, layers: int | None = None) -> Qwen3ForCausalLM:
        config = Qwen3Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=layers or self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tied,
            pad_token_id=0,
            eos_token_id=3,
            bos_token_id=None,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
        return model.eval()

    def memory_shape(self, layers: int) -> ModelShape:
        return ModelShape(
            layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
            self.vocab, self.tied,
        )  # fmt: skip


def peaked(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """Next-token distributions far from uniform, as a trained model's are: the output layer
    scaled up (random weights give logits of std ≈ 0.6 over 152k tokens: nearly flat)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


QWEN3_8B = Shape(36, 4096, 32, 8, 128, 12288, 151_936, tied=False)
QWEN3_17B = Shape(28, 2048, 16, 8, 128, 6144, 151_936, tied=True)
QWEN3_06B = Shape(28, 1024, 16, 8, 128, 3072, 151_936, tied=True)
TINY = Shape(2, 64, 4, 2, 16, 128, 512, tied=True)


def synthetic_trees(
    groups: int, size: int, tokens: tuple[int, int], vocab: int, rng: np.random.Generator
) -> list[RolloutTree]:
    """One-turn groups of random tokens, every other leaf rewarded (no group is flat); every
    sampling logprob is ``-ln vocab``, what a near-uniform policy gives."""
    prompt_tokens, new_tokens = tokens
    logprob = -math.log(vocab)
    trees = []
    for g in range(groups):
        prompt = rng.integers(4, vocab, size=prompt_tokens).astype(np.int32)
        builder = TreeBuilder(
            TreeInfo(prompt_id=f"gpu-check-{g}", tree_id=g, strategy="grpo"), prompt_tokens=prompt
        )
        for k in range(size):
            leaf = builder.add_turn(
                0,
                gen_tokens=rng.integers(4, vocab, size=new_tokens),
                logprobs=np.full(new_tokens, logprob),
            )
            builder.set_reward(leaf, float(k % 2))
        trees.append(builder.build())
    return trees
