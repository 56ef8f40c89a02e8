"""Held-out evaluation: pass@1 (greedy) and mean@k (k samples at temperature 1), per difficulty.

Both run the real multi-turn loop (engine samples a turn, the env answers) on the eval split,
through ``rollout_flat``, so an evaluation episode is exactly a rollout without the update.

    report = evaluate_policy(engine, fmt, suite.make_env, suite.tasks("eval")[:200], k=4, seed=0)
    report.pass1["all"], report.mean_k["hard"]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Env, Task, parse_action
from trace_core.policy.engine import Engine, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.rollout.flat import rollout_flat

ALL = "all"


@dataclass(frozen=True)
class EvalReport:
    tasks: int
    k: int
    pass1: dict[str, float]
    """Greedy success rate per difficulty, and over all tasks under ``"all"``."""
    mean_k: dict[str, float]
    """Mean success of k samples at temperature 1 per difficulty, and under ``"all"``."""
    tokens: int
    """Generated tokens the evaluation took (not part of any training budget)."""
    parse_rate: float = float("nan")
    """Share of the evaluation's turns (greedy and sampled) that end in a parsable action."""
    truncated: float = float("nan")
    """Share of those turns cut by ``max_tokens`` before their end-of-turn token."""

    def as_dict(self) -> dict[str, object]:
        return {
            "tasks": self.tasks,
            "k": self.k,
            "pass1": self.pass1,
            "mean_k": self.mean_k,
            "parse_rate": self.parse_rate,
            "truncated": self.truncated,
        }


def evaluate_policy(
    engine: Engine,
    fmt: TurnFormat,
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    k: int,
    seed: int,
    max_tokens: int = 48,
) -> EvalReport:
    if not tasks:
        raise ValueError("no eval tasks")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    greedy = rollout_flat(
        engine, fmt, make_env, tasks, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed
    )
    played = list(greedy)
    pass1 = _by_difficulty(tasks, [float(t.reward[t.leaf_mask].mean()) for t in greedy])
    mean_k: dict[str, float] = {}
    if k:
        sampled = rollout_flat(
            engine,
            fmt,
            make_env,
            tasks,
            SamplingParams(n=k, temperature=1.0, max_tokens=max_tokens),
            seed + 1,
        )
        played += sampled
        mean_k = _by_difficulty(tasks, [float(t.reward[t.leaf_mask].mean()) for t in sampled])
    tokens = sum(t.generated_tokens for t in played)
    truncated = [bool(cut) for t in played for cut in t.truncated[1:]]
    cut = float(np.mean(truncated)) if truncated else 0.0
    return EvalReport(len(tasks), k, pass1, mean_k, tokens, parse_rate(played), cut)


def parse_rate(trees: Sequence[RolloutTree]) -> float:
    """Share of turns (every non-root node) whose text ends in an action the parser reads."""
    turns = [text for tree in trees for text in tree.text[1:]]
    return float(np.mean([parse_action(t) is not None for t in turns])) if turns else 0.0


def _by_difficulty(tasks: Sequence[Task], scores: Sequence[float]) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for task, score in zip(tasks, scores, strict=True):
        groups[task.difficulty].append(score)
    out = {name: float(np.mean(v)) for name, v in sorted(groups.items())}
    out[ALL] = float(np.mean(scores))
    return out
