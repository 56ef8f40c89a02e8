"""The run log: one ``IterationRecord`` per iteration, one JSON line each (``log.jsonl``), kept by
``trace-rl train`` in its run folder and carried inside the policy artifact by the pipeline."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LOG = "log.jsonl"


@dataclass(frozen=True)
class IterationRecord:
    """One line of ``log.jsonl``."""

    iteration: int
    """0 is the starting policy (evaluation only); training iterations count from 1."""
    strategy: str
    tokens: int
    """Generated rollout tokens of this iteration."""
    total_tokens: int
    """Generated rollout tokens of every iteration up to this one."""
    rollout: dict[str, float]
    update: dict[str, float]
    eval: dict[str, object] | None
    seconds: dict[str, float]
    predictor: dict[str, float] = field(default_factory=dict)
    """The predictor fit: rows, replayed rows, weighted MSE before and after, skills; where the
    iteration was evaluated, ``eval_root_skill`` (``iteration.held_out_root_skill``)."""
    storage: dict[str, float] = field(default_factory=dict)
    """A pipeline step's bytes through object storage: ``s3_bytes`` besides checkpoints and
    ``checkpoint_bytes`` of the checkpoints it committed (``trace-rl train``: none)."""
    staleness: int = 0
    """The version the update started from (iteration - 1) less the version that grew its
    trees (their ``policy_version``): 0 synchronous, at most ``max_staleness``."""
    idle: dict[str, float] = field(default_factory=dict)
    """Seconds of the iteration the ``engines`` and the ``trainers`` spent idle."""


def read_log(out: Path) -> list[IterationRecord]:
    path = out / LOG
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            records.append(IterationRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"{path}, line {n}: not an iteration record ({err})") from None
    return records
