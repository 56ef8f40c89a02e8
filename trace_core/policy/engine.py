"""The engine protocol: sample the next turn for a batch of token-id prefixes.

An engine knows nothing about text, tasks or trees; it is purely token id sequences, like
nanochat's. Token ids in, token ids out: the history is never re-tokenised, so a training
sequence is exactly the concatenation of what was sampled and what the env returned.

Engines: ``TorchEngine`` (our own batched decode loop with a prefix cache, CPU or CUDA) and
``VLLMEngine`` (vLLM with prefix caching; optional extra, imported lazily).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt; they share the prompt's prefill."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_tokens: int = 64
    """Generated tokens per sample at most, the stop token included."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling stops after any of these (the action-end token); it is kept in the output."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: npt.NDArray[np.int32]
    """Generated ids, ending with the stop token when ``finished``."""
    logprobs: npt.NDArray[np.float32]
    """log p(token) under the model at temperature 1 (before temperature and top-p), per token."""
    finished: bool
    """True when a stop token ended it; False when ``max_tokens`` did."""


@dataclass
class EngineStats:
    """Counters an engine keeps across calls (for benchmarks and reports)."""

    prompt_tokens: int = 0
    """Prompt tokens requested, counted once per prompt (not per sample)."""
    prefill_tokens: int = 0
    """Prompt tokens actually run through the model (the rest came from the prefix cache)."""
    generated_tokens: int = 0
    calls: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """Every engine refuses an empty prompt: there is nothing to continue from."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")


class Engine(Protocol):
    stats: EngineStats

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``params.n`` completions for every prompt, in prompt order. ``seed``: one per
        prompt (what a rollout passes: each request's own, ``rollout.turn.turn_seed``), or one
        for the call (prompt ``i`` then gets ``sampling.request_seed(seed, i)``), or None."""
        ...
