"""Held-out evaluation: pass@1 (greedy) and mean@k (k samples at temperature 1), per difficulty.

Both run the real multi-turn loop (engine samples a turn, the env answers) on the eval split,
through ``rollout_flat``, so an evaluation episode is exactly a rollout without the update.

    report = evaluate_policy(engine, fmt, suite.make_env, suite.tasks("eval")[:200], k=4, seed=0)
    report.pass1["all"], report.mean_k["hard"]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
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
    per_task: dict[str, list[float]] | None = None
    """Each task's greedy reward (``pass1``) and mean sampled reward (``mean_k``), in the order
    of ``task_ids``: what a paired comparison of two evaluations reads (``paired_change``)."""
    task_ids: tuple[str, ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()
    """Held-out tasks whose env failed (a retrieval service that stayed down), each with its
    one-line error: not in any figure above."""

    def as_dict(self) -> dict[str, object]:
        body: dict[str, object] = {
            "tasks": self.tasks,
            "k": self.k,
            "pass1": self.pass1,
            "mean_k": self.mean_k,
            "parse_rate": self.parse_rate,
            "truncated": self.truncated,
        }
        if self.per_task is not None:
            body["per_task"] = {"ids": list(self.task_ids), **self.per_task}
        if self.left_out:
            body["left_out"] = [list(pair) for pair in self.left_out]
        return body


@dataclass(frozen=True)
class PairedChange:
    """final − start over the same tasks: the mean and its 95% interval (normal approximation
    of the per-task differences' mean: mean ± 1.96 · sd / √n)."""

    mean: float
    low: float
    high: float
    tasks: int

    def text(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def paired_change(
    start: Mapping[str, object], final: Mapping[str, object], metric: str
) -> PairedChange | None:
    """The paired change of ``metric`` (``pass1`` or ``mean_k``) between two evaluation reports
    (``EvalReport.as_dict``); None when either lacks per-task results or their tasks differ."""
    a, b = start.get("per_task"), final.get("per_task")
    if not isinstance(a, Mapping) or not isinstance(b, Mapping) or a.get("ids") != b.get("ids"):
        return None
    before, after = np.asarray(a.get(metric) or []), np.asarray(b.get(metric) or [])
    if len(before) == 0 or len(before) != len(after):
        return None
    diff = after - before
    half = 1.96 * float(diff.std(ddof=1)) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    mean = float(diff.mean())
    return PairedChange(mean, mean - half, mean + half, len(diff))


def evaluate_policy(
    engine: Engine,
    fmt: TurnFormat,
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    k: int,
    seed: int,
    max_tokens: int = 48,
    stage: Callable[[str], None] | None = None,
) -> EvalReport:
    """``stage(what)`` before the greedy episodes and before the sampled ones."""
    say = stage or (lambda _what: None)
    if not tasks:
        raise ValueError("no eval tasks")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    say(f"greedy episodes on {len(tasks)} held-out tasks")
    failed: dict[int, str] = {}
    greedy = rollout_flat(
        engine,
        fmt,
        make_env,
        tasks,
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        seed,
        failed=failed,
    )
    sampled: list[RolloutTree] = []
    if k:
        say(f"{k} sampled episodes on each of the {len(tasks)} tasks")
        sampled = rollout_flat(
            engine,
            fmt,
            make_env,
            tasks,
            SamplingParams(n=k, temperature=1.0, max_tokens=max_tokens),
            seed + 1,
            failed=failed,
        )
    # A task whose env failed in either pass is left out of both: its figures would be those
    # of the episodes that happened to finish.
    kept = [i for i in range(len(tasks)) if i not in failed]
    if not kept:
        first = min(failed)
        raise RuntimeError(
            f"every held-out task's env failed; task {tasks[first].id}: {failed[first]}"
        )
    scored = [tasks[i] for i in kept]
    played = [greedy[i] for i in kept]
    greedy_scores = [float(greedy[i].reward[greedy[i].leaf_mask].mean()) for i in kept]
    pass1 = _by_difficulty(scored, greedy_scores)
    per_task = {"pass1": greedy_scores}
    mean_k: dict[str, float] = {}
    if k:
        played += [sampled[i] for i in kept]
        sampled_scores = [float(sampled[i].reward[sampled[i].leaf_mask].mean()) for i in kept]
        mean_k = _by_difficulty(scored, sampled_scores)
        per_task["mean_k"] = sampled_scores
    tokens = sum(t.generated_tokens for t in played)
    truncated = [bool(cut) for t in played for cut in t.truncated[1:]]
    cut = float(np.mean(truncated)) if truncated else 0.0
    ids = tuple(task.id for task in scored)
    left_out = tuple((tasks[i].id, failed[i]) for i in sorted(failed))
    return EvalReport(
        len(scored), k, pass1, mean_k, tokens, parse_rate(played), cut, per_task, ids, left_out
    )


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
