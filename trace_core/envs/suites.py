"""Every task suite by name, and the reference check a user runs first on a task.

    trace-rl task check calc
    trace-rl task check deepscaler --data train.parquet --json check.json

``check_references`` replays each task's reference turns (scripted demonstrations for the
synthetic suites, ground truth for bfcl and the loaders) through a fresh env; anything but a
mean reward of 1.0 means the task, its loader or its env is broken.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from trace_core.envs.base import TaskSuite, replay

SUITES = ("calc", "calc-mix", "multihop", "bfcl", "deepscaler", "hotpotqa")
SYNTHETIC = ("calc", "calc-mix", "multihop")
TASK_HELP = f"{', '.join(SUITES[:-1])} or {SUITES[-1]}."
"""The ``--task`` help of every command."""
"""The suites with scripted demonstrations: the only ones the tiny policy warm-starts on."""
RETRIEVAL = ("multihop", "hotpotqa")
"""The suites that can search a retrieval service (``retriever_url``) instead of their own
in-process index."""


def make_suite(
    name: str, data: str | None = None, seed: int = 0, retriever_url: str | None = None
) -> TaskSuite:
    """The suite called ``name``; ``data`` is the dataset URI of the loader suites;
    ``retriever_url`` the retrieval service the ``RETRIEVAL`` suites search (None or empty: their
    in-process index)."""
    if name in ("deepscaler", "hotpotqa") and not data:
        raise ValueError(f"task {name!r} reads a dataset: pass its path or URI (--data)")
    if retriever_url and name in SUITES and name not in RETRIEVAL:
        raise ValueError(
            f"retriever_url {retriever_url!r}: task {name!r} searches no passages (only "
            f"{' and '.join(RETRIEVAL)} do); leave it empty"
        )
    retriever_url = retriever_url or None
    match name:
        case "calc":
            from trace_core.envs.calc import CalcSuite

            return CalcSuite(seed=seed)
        case "calc-mix":
            from trace_core.envs.calc import CalcMixSuite

            return CalcMixSuite(seed=seed)
        case "multihop":
            from trace_core.envs.multihop import MultihopSuite

            return MultihopSuite(seed=seed, retriever_url=retriever_url)
        case "bfcl":
            from trace_core.envs.bfcl import BfclSuite

            return BfclSuite()
        case "deepscaler":
            from trace_core.envs.deepscaler import DeepScaleRSuite

            return DeepScaleRSuite(str(data))
        case "hotpotqa":
            from trace_core.envs.hotpotqa import HotpotQASuite

            return HotpotQASuite(str(data), retriever_url=retriever_url)
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(SUITES)}")


@dataclass(frozen=True)
class CheckReport:
    task: str
    tasks: int
    """Tasks replayed (both splits; tasks without a reference are not counted)."""
    mean_reward: float
    without_reference: int
    by_difficulty: dict[str, float]
    failed: list[str]
    """Ids of tasks whose reference did not score 1 (first 20)."""

    def to_json(self) -> dict[str, object]:
        return {
            "task": self.task,
            "tasks": self.tasks,
            "mean_reward": self.mean_reward,
            "without_reference": self.without_reference,
            "by_difficulty": self.by_difficulty,
            "failed": self.failed,
        }


def check_references(suite: TaskSuite) -> CheckReport:
    rewards: dict[str, list[float]] = defaultdict(list)
    failed: list[str] = []
    skipped = 0
    env = suite.make_env()
    for split in ("train", "eval"):
        for task in suite.tasks(split):
            if not task.reference:
                skipped += 1
                continue
            _, last = replay(env, task, task.reference)
            reward = last.reward if last is not None and last.done else 0.0
            rewards[task.difficulty].append(reward)
            if reward != 1.0 and len(failed) < 20:
                failed.append(task.id)
    every = [r for group in rewards.values() for r in group]
    return CheckReport(
        task=suite.name,
        tasks=len(every),
        mean_reward=float(np.mean(every)) if every else 0.0,
        without_reference=skipped,
        by_difficulty={k: float(np.mean(v)) for k, v in sorted(rewards.items())},
        failed=failed,
    )
