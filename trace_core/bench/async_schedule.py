"""``trace-rl bench async``: what bounded staleness buys on one Ray head.

The same training run (``trace-rl train``'s loop, ``train.phases``) at each ``max_staleness``
k asked for, one after another on one Ray head, with trainer actors and engine actors of their
own (``train_workers``, ``engine.workers``, their thread counts stated in the result). At
k = 0 an iteration rolls out and then updates; at k >= 1 the trees ahead grow on the engine
actors while the trainer actors update. Per k, from the run's own records:

* ``seconds_per_iteration``: the iterations' wall time without their held-out evaluation
  (the same for every k), mean over the same iterations for every k: those after the largest
  k asked for (the start grows k extra rollouts: ``fill_seconds`` is the first iteration's);
* ``engine_idle_share``, ``trainer_idle_share``: the share of that time the engines (not
  rolling out) and the trainers (not updating or checkpointing) sat idle;
* ``staleness``: what each iteration's update saw (``IterationRecord.staleness``);
* ``speedup_vs_0``: k = 0's seconds per iteration over this k's, in the same command.

    from trace_core.bench.async_schedule import run_async_bench
    print(run_async_bench(Path("build/policy/calc"), staleness=(0, 1), iterations=4))
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from trace_core.policy.update_config import UpdateConfig
from trace_core.rollout.engine_config import EngineConfig
from trace_core.train.config import TrainConfig, is_builtin_tiny
from trace_core.train.record import IterationRecord


def run_async_bench(
    checkpoint: Path,
    staleness: Sequence[int] = (0, 1, 2),
    iterations: int = 4,
    task: str = "calc",
    budget: int = 32,
    prompts: int = 64,
    max_tokens: int = 48,
    trainers: int = 1,
    engines: int = 1,
    threads: int = 1,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Each k of ``staleness`` as one run of ``iterations`` (see the module docstring)."""
    from trace_core.rollout.ray_pool import ray_session
    from trace_core.train.loop import train

    if not staleness or min(staleness) < 0 or 0 not in staleness:
        raise ValueError(f"staleness: give k >= 0 values including 0, got {list(staleness)}")
    if iterations <= max(staleness):
        raise ValueError(
            f"iterations ({iterations}) must exceed the largest k ({max(staleness)}): the "
            "first k iterations grow the start's extra rollouts"
        )
    say = say or (lambda _message: None)
    tiny = is_builtin_tiny(checkpoint)
    base = TrainConfig(
        task=task,
        init=str(checkpoint),
        iterations=iterations,
        budget=budget,
        prompts=prompts,
        max_tokens=max_tokens,
        seed=seed,
        eval_tasks=8,
        eval_k=1,
        eval_every=iterations,
        checkpoint_every=iterations,
        train_workers=trainers,
        engine=EngineConfig(workers=engines, threads_per_worker=threads),
        # A pretrained model: RL's small step (``config.PRETRAINED``); the compute is the same.
        update=UpdateConfig() if tiny else UpdateConfig(lr=1e-6, micro_tokens=4096),
    )
    runs: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp, ray_session(None):
        for k in staleness:
            say(f"max_staleness {k}: {iterations} iterations")
            config = replace(base, output=Path(tmp) / f"k{k}", max_staleness=k)
            runs[str(k)] = _figures(train(config)[1:], max(staleness))
    zero = runs["0"]["seconds_per_iteration"]
    for figures in runs.values():
        figures["speedup_vs_0"] = float(zero) / float(figures["seconds_per_iteration"])  # type: ignore[arg-type]
    return {
        "checkpoint": str(checkpoint),
        "task": task,
        "iterations": iterations,
        "budget": budget,
        "trainer_actors": trainers,
        "engine_actors": engines,
        "threads_per_actor": threads,
        "runs": runs,
    }


def _figures(records: Sequence[IterationRecord], after: int) -> dict[str, object]:
    walls = [_wall(r) for r in records]
    steady = walls[after:]  # iterations > after (run_async_bench: more than the largest k)
    busy = sum(walls)
    return {
        "seconds_per_iteration": statistics.fmean(steady),
        "fill_seconds": walls[0],
        "engine_idle_share": sum(r.idle.get("engines", 0.0) for r in records) / busy,
        "trainer_idle_share": sum(_trainers_idle(r) for r in records) / busy,
        "staleness": [r.staleness for r in records],
        "iteration_seconds": walls,
    }


def _trainers_idle(record: IterationRecord) -> float:
    """The trainers' idle seconds outside the evaluation (they sit out every evaluation)."""
    return max(record.idle.get("trainers", 0.0) - record.seconds.get("eval", 0.0), 0.0)


def _wall(record: IterationRecord) -> float:
    """An iteration's wall time without its evaluation: the engines' busy time (rollout) and
    idle time add up to it (``phases._idle``)."""
    return record.seconds.get("rollout", 0.0) + record.idle.get("engines", 0.0)
