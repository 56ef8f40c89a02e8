"""What an engine actor answers: a sub-batch's completions and the work they took
(``SubBatchResult``, from ``EngineWorker.generate``), or the turns its running batch finished
since the last ``collect`` (``Collected``, the same with the turns' ids)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trace_core.policy.engine import Completion


@dataclass(frozen=True)
class SubBatchResult:
    """What a worker returns for one sub-batch: completions and the work it took."""

    completions: list[list[Completion]]
    prompt_tokens: int
    prefill_tokens: int
    generated_tokens: int
    seconds: float
    """Time inside the engine (the worker was busy)."""
    cache_used_tokens: float
    steps: int = 0
    """TorchEngine: decode steps run."""
    row_steps: int = 0
    """TorchEngine: rows in flight summed over those steps."""
    row_counts: dict[int, int] = field(default_factory=dict)
    """Those steps by their rows in flight."""


@dataclass(frozen=True)
class Collected(SubBatchResult):
    """Turns an engine's running batch answered since the last ``collect``
    (``rollout.batch_loop``): ``completions`` holds each turn's ``params.n`` samples, in
    sample order, and ``seconds`` the time spent stepping the batch."""

    ids: list[int] = field(default_factory=list)
