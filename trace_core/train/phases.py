"""One training iteration, written once: the local loop (``train.loop``) and the pipeline's
iteration step (``train.steps.session``) both call ``run_iteration``, so a run's records, log
lines and updates do not depend on where it runs.

    draw → rollout → fit ∥ update → sync → checkpoint? → evaluate? → record

    run = Run(config, "nightly", suite, ..., weights=weights, session=session)
    outcome = run_iteration(run, 3, persist)   # persist: where the trees (and checkpoint) go
    say(iteration_line(run.config, outcome))

``persist(i, trees, metrics, save)`` stores the iteration's trees and metrics, and, on a
checkpoint iteration, calls ``save(folder)`` to write the checkpoint into the folder it is to
be found in (``Run.checkpoint_at(i)``). The fit runs beside the update when the update runs on
trainer actors (it then costs no wall time); in this process they take turns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trace_core.algo.metrics import BatchMetrics
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Task, TaskSuite
from trace_core.policy.format import TurnFormat
from trace_core.policy.predictor import SharedPredictor
from trace_core.policy.tokenizer import padding_id
from trace_core.policy.update import UpdateStats
from trace_core.policy.weight_sync import SYNCED
from trace_core.rollout.engines import EngineSession
from trace_core.train import iteration
from trace_core.train.config import TrainConfig
from trace_core.train.draws import draw_iteration
from trace_core.train.evaluate import ALL, EvalReport
from trace_core.train.record import IterationRecord
from trace_core.train.weights import Weights

Save = Callable[[str | Path], None]
Persist = Callable[[int, Sequence[RolloutTree], BatchMetrics, Save | None], None]


@dataclass
class Run:
    """What one iteration reads and changes: the run's policy (here, or resident in
    ``weights.trainers``), predictor, engines, and where its newest checkpoint is."""

    config: TrainConfig
    run_id: str
    """The trees' ``run_id`` and the sync labels' run."""
    suite: TaskSuite
    train_tasks: Sequence[Task]
    eval_tasks: Sequence[Task]
    fmt: TurnFormat
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    serving: torch.dtype
    optimizer: torch.optim.Optimizer
    reference: PreTrainedModel | None
    predictor: SharedPredictor
    weights: Weights
    session: EngineSession
    serving_now: str
    """What the engines are to serve: a checkpoint folder, or a sync label."""
    checkpointed: int
    """The newest checkpoint's iteration (0: the start)."""
    checkpoint_at: Callable[[int], str]
    """Iteration → the folder (path or ``s3://`` prefix) its checkpoint is written to."""
    total_tokens: int
    """Rollout tokens generated before the next iteration."""
    started: int = 0
    """The iteration of the checkpoint ``weights`` started from (``weights.start``)."""
    always_checkpoint: bool = False
    """Checkpoint every iteration: the training state does not outlive this process."""


@dataclass(frozen=True)
class Outcome:
    record: IterationRecord
    trees: Sequence[RolloutTree]
    metrics: BatchMetrics
    stats: UpdateStats
    report: EvalReport | None


def evaluate(run: Run, policy: str | Path) -> EvalReport:
    """Held-out accuracy of the policy the engines serve as ``policy``, on the run's engines."""
    return iteration.evaluate(
        policy, run.fmt, run.suite.make_env, run.eval_tasks, run.config, model=run.model,
        session=run.session,
    )  # fmt: skip


def run_iteration(
    run: Run, i: int, persist: Persist, say: Callable[[str], None] | None = None
) -> Outcome:
    """Iteration ``i`` of ``run`` (see the module docstring); ``run`` is left after it."""
    say = say or (lambda _message: None)
    config, session, weights = run.config, run.session, run.weights
    draws = draw_iteration(config.seed, i, len(run.train_tasks), config.prompts)
    seconds: dict[str, float] = {}
    reloaded = session.reload_seconds
    rollout = iteration.roll_out(
        run.serving_now, run.train_tasks, run.suite, run.predictor, config, i, draws,
        run_id=run.run_id, model=run.model, tokenizer=run.tokenizer, session=session,
    )  # fmt: skip
    trees, metrics = rollout.trees, rollout.metrics
    seconds["rollout"] = rollout.seconds
    # A lost trainer group comes back from the newest checkpoint, if nothing was trained since.
    folder = run.checkpoint_at(run.checkpointed) if run.checkpointed != run.started else None
    weights.recover(run.checkpointed, folder, run.checkpointed == i - 1, say)
    start = time.perf_counter()
    if weights.trainers is not None:  # on the trainer actors, while this process fits
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(weights.trainers.update, trees, draws.update_seed)
            fit = iteration.fit_predictor(run.predictor, trees, draws)
            seconds["predictor"] = time.perf_counter() - start
            stats = pending.result()
    else:
        fit = iteration.fit_predictor(run.predictor, trees, draws)
        seconds["predictor"] = time.perf_counter() - start
        start = time.perf_counter()
        stats = iteration.update(
            run.model, run.optimizer, trees, config, draws, padding_id(run.tokenizer),
            run.reference, run.serving,
        )  # fmt: skip
    seconds["update"] = time.perf_counter() - start
    # New weights into the engines by broadcast, unless they load files only.
    start = time.perf_counter()
    label = weights.sync(session, f"{SYNCED}{run.run_id}:{i}")
    if label:
        run.serving_now = label
        seconds["sync"] = time.perf_counter() - start
    checkpoint = i % config.checkpoint_every == 0 or i == config.iterations or not label
    checkpoint = checkpoint or run.always_checkpoint
    start = time.perf_counter()
    save = weights.saver(run.model, run.tokenizer, run.optimizer) if checkpoint else None
    persist(i, trees, metrics, save)
    if checkpoint:
        seconds["checkpoint"] = time.perf_counter() - start
        run.checkpointed = i
        run.serving_now = label or f"{run.checkpoint_at(i)}/policy"
    report, held_out = None, {}
    if i % config.eval_every == 0 or i == config.iterations:
        start = time.perf_counter()
        report = evaluate(run, run.serving_now)
        seconds["eval"] = time.perf_counter() - start
        skill = iteration.held_out_root_skill(run.predictor, run.fmt, run.eval_tasks, report)
        held_out = {"eval_root_skill": skill} if math.isfinite(skill) else {}
    if session.reload_seconds > reloaded:  # the kept engine took a policy in place
        seconds["reload"] = session.reload_seconds - reloaded
    run.total_tokens += metrics.tokens
    record = IterationRecord(
        iteration=i,
        strategy=config.strategy,
        tokens=metrics.tokens,
        total_tokens=run.total_tokens,
        rollout=metrics.as_dict(),
        update=stats.as_dict(),
        eval=eval_dict(report) if report else None,
        seconds=seconds,
        predictor={
            **{k: float(v) for k, v in asdict(fit).items() if math.isfinite(v)},
            **held_out,
        },
    )
    return Outcome(record, trees, metrics, stats, report)


def start_record(run: Run, policy: str | Path) -> IterationRecord:
    """Iteration 0's record: the starting policy's held-out accuracy."""
    start = time.perf_counter()
    report = evaluate(run, policy)
    seconds = {"eval": time.perf_counter() - start}
    return IterationRecord(0, run.config.strategy, 0, 0, {}, {}, eval_dict(report), seconds)


def eval_dict(report: EvalReport) -> dict[str, object]:
    return {**report.as_dict(), "tokens": report.tokens}


def iteration_line(config: TrainConfig, outcome: Outcome) -> str:
    """ "iteration 3/12: 9,812 tokens, prompt effective ratio 0.41, ...; rollout 41 s, ..."."""
    record, report = outcome.record, outcome.report
    accuracy = f", mean@{config.eval_k} {report.mean_k[ALL]:.3f}" if report else ""
    skill_text = "".join(
        f", predictor {label} {record.predictor[key]:+.2f}"
        for key, label in (("root_skill", "root skill"), ("eval_root_skill", "held out"))
        if key in record.predictor
    )
    phases = phases_line(record.seconds, outcome.stats)
    return (
        f"iteration {record.iteration}/{config.iterations}: {record.tokens:,} tokens, prompt "
        f"effective ratio {outcome.metrics.prompt_effective_ratio:.2f}{skill_text}{accuracy}; "
        f"{phases}"
    )


def phases_line(seconds: dict[str, float], stats: UpdateStats) -> str:
    """Seconds per phase, and what the update measured: "rollout 41 s, predictor 0 s, update
    3 s (12 paths, peak 2.1 GiB of which 1.5 held before it, logprob gap 3.0e-05), eval 20 s"."""
    parts = []
    for phase, value in seconds.items():
        part = f"{phase} {value:.0f} s"
        if phase == "update":
            part += (
                f" ({stats.paths} paths, peak {stats.peak_gib:.1f} GiB of which "
                f"{stats.held_gib:.1f} held before it, logprob gap {stats.logprob_gap:.1e})"
                if stats.paths
                else " (no path with an advantage: every group was all-success or all-failure)"
            )
        parts.append(part)
    return ", ".join(parts)
