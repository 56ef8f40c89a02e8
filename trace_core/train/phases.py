"""One training iteration, written once: the local loop (``train.loop``) and the pipeline's
iteration step (``train.steps.session``) both call ``run_iteration``, so a run's records, log
lines and updates do not depend on where it runs.

    draw → rollout → fit ∥ update → sync → checkpoint? → evaluate? → record

With ``max_staleness`` k >= 1 the rollout moves ahead: iteration i's trees were grown earlier
(the first k at the start, on the starting policy), and while iteration i updates, the trees
of iteration i + k grow on the weights the engines hold, iteration i - 1's:

    fit → rollout of i + k ∥ update of i → sync → checkpoint? → evaluate? → record

The engines' weights change only at the sync, between rollouts, so every tree of an
iteration is grown by one policy version (its ``policy_version``: the iteration whose update
made it) and the update of i starts from weights at most k versions newer
(``IterationRecord.staleness``). With the per-request seeds nothing depends on timing: trees
grown ahead are the trees a slower or faster run grows, kept as the run's state
(``Run.keep_ahead``) and read back by a resumed run instead of grown again. They grow whatever
the run's ``iterations`` (the last iterations grow the k after it), so a run taken further
later equals one that ran that far at once. The rollout and
the update overlap where the update runs on trainer actors; in this process the trees ahead
grow first, so the update never changes weights a rollout is reading.

    run = Run(config, "nightly", suite, ..., weights=weights, session=session)
    outcome = run_iteration(run, 3, persist)   # persist: where the trees (and checkpoint) go
    say(iteration_line(run.config, outcome))

Faults. A trainer actor that dies, before the update or during it (or the sync after it), is
rebuilt from the newest checkpoint when nothing was trained since, and the update is done again
on the same trees (``Weights.recover``); else the run stops with one line naming the checkpoint
a rerun resumes from. An engine actor Ray restarted during a rollout has lost the synced weights
it served: the engines load them from their checkpoint and the trees grow again (the same
trees), or, where no checkpoint holds them, the run stops with one line (``EnginesLostError``).

``persist(i, trees, metrics, save)`` stores the iteration's trees and metrics, and, on a
checkpoint iteration, calls ``save(folder)`` to write the checkpoint into the folder it is to
be found in (``Run.checkpoint_at(i)``). The fit runs beside the update when the update runs on
trainer actors (it then costs no wall time); in this process they take turns.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trace_core.algo.metrics import BatchMetrics
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Task, TaskSuite
from trace_core.policy.format import TurnFormat
from trace_core.policy.predictor import FitReport, SharedPredictor
from trace_core.policy.tokenizer import padding_id
from trace_core.policy.update import UpdateStats
from trace_core.policy.weight_sync import SYNCED
from trace_core.rollout.engines import EngineSession
from trace_core.rollout.phase import RolloutResult
from trace_core.train import iteration
from trace_core.train.config import TrainConfig
from trace_core.train.draws import IterationDraws, draw_iteration
from trace_core.train.evaluate import ALL, EvalReport
from trace_core.train.record import IterationRecord
from trace_core.train.weights import EnginesLostError, Weights

Save = Callable[[str | Path], None]
Persist = Callable[[int, Sequence[RolloutTree], BatchMetrics, Save | None], None]
KeepAhead = Callable[[int, Sequence[RolloutTree]], None]


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
    serving_version: int = 0
    """The iteration whose update made the weights the engines serve (0: the start)."""
    ahead: dict[int, RolloutResult] = field(default_factory=dict)
    """Trees grown for iterations not updated yet (``max_staleness`` >= 1), by iteration."""
    fitted_through: int = 0
    """The newest iteration whose trees the predictor has been fitted on."""
    keep_ahead: KeepAhead | None = None
    """Where trees grown ahead are kept as soon as they are grown: the run's state."""
    stored_trees: Callable[[int, Sequence[RolloutTree]], str] | None = None
    """Where iteration i's trees lie in the store before its update (they are put there if
    they are not yet): the trainer actors read them there, not from this process's memory."""


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
    k = config.max_staleness
    draws = _draws(run, i)
    seconds: dict[str, float] = {}
    began = time.perf_counter()
    reloaded = session.reload_seconds
    fits: list[FitReport] = []
    # The trees of i, and with k >= 1 those up to i + k - 1 not grown yet (the start's: on the
    # starting policy), each allocated by the predictor fitted on every tree before it.
    for j in range(i, i + max(k, 1)):
        if j not in run.ahead:
            if k:
                fits += _fit_through(run, j - 1, seconds)
            run.ahead[j] = _grow(run, j, seconds, say)
            if j > i and run.keep_ahead is not None:
                run.keep_ahead(j, run.ahead[j].trees)
    trees, metrics = run.ahead[i].trees, run.ahead[i].metrics
    # A lost trainer group comes back from the newest checkpoint, if nothing was trained since.
    folder = run.checkpoint_at(run.checkpointed) if run.checkpointed != run.started else None

    def recover() -> bool:
        return weights.recover(run.checkpointed, folder, run.checkpointed == i - 1, say)

    recover()

    def timed_update() -> tuple[UpdateStats, float]:
        start = time.perf_counter()
        if weights.trainers is not None:
            stored = run.stored_trees(i, trees) if run.stored_trees is not None else None
            stats = weights.trainers.update(stored or trees, draws.update_seed)
        else:
            pad_id = padding_id(run.tokenizer)
            stats = iteration.update(
                run.model, run.optimizer, trees, config, draws, pad_id, run.reference, run.serving
            )
        return stats, time.perf_counter() - start

    def alongside() -> None:
        """What runs while the trainers update: the fit, and the rollout ahead."""
        if not k:
            fits.extend(_fit_through(run, i, seconds))
            return
        fits.extend(_fit_through(run, i + k - 1, seconds))
        run.ahead[i + k] = _grow(run, i + k, seconds, say)
        if run.keep_ahead is not None:
            run.keep_ahead(i + k, run.ahead[i + k].trees)

    def timed_sync() -> tuple[str | None, float]:
        """New weights into the engines by broadcast (None: they load files only)."""
        start = time.perf_counter()
        label = weights.sync(session, f"{SYNCED}{run.run_id}:{i}")
        return label, time.perf_counter() - start

    if weights.trainers is not None:  # on the trainer actors, while this process goes on
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(timed_update)
            alongside()
            try:
                stats, seconds["update"] = pending.result()
                label, synced = timed_sync()
            except Exception:
                # A trainer actor died in the update or the sync: the update again, on
                # trainers rebuilt from the newest checkpoint (or one line, if it is older).
                if not recover():
                    raise
                stats, seconds["update"] = timed_update()
                label, synced = timed_sync()
    else:  # in this process: first what reads the weights before this update
        alongside()
        stats, seconds["update"] = timed_update()
        label, synced = timed_sync()
    if label:
        run.serving_now = label
        seconds["sync"] = synced
    checkpoint = i % config.checkpoint_every == 0 or i == config.iterations or not label
    checkpoint = checkpoint or run.always_checkpoint
    start = time.perf_counter()
    save = weights.saver(run.model, run.tokenizer, run.optimizer) if checkpoint else None
    persist(i, trees, metrics, save)
    del run.ahead[i]
    if checkpoint:
        seconds["checkpoint"] = time.perf_counter() - start
        run.checkpointed = i
        run.serving_now = label or f"{run.checkpoint_at(i)}/policy"
    run.serving_version = i
    report, held_out = None, {}
    if i % config.eval_every == 0 or i == config.iterations:
        start = time.perf_counter()
        report = evaluate(run, run.serving_now)
        seconds["eval"] = time.perf_counter() - start
        for task, error in report.left_out:
            say(f"iteration {i}: held-out task {task} left out of the evaluation: {error}")
        skill = iteration.held_out_root_skill(run.predictor, run.fmt, run.eval_tasks, report)
        held_out = {"eval_root_skill": skill} if math.isfinite(skill) else {}
    if session.reload_seconds > reloaded:  # the kept engine took a policy in place
        seconds["reload"] = session.reload_seconds - reloaded
    run.total_tokens += metrics.tokens
    fit = fits[-1] if fits else None
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
            **({n: float(v) for n, v in asdict(fit).items() if math.isfinite(v)} if fit else {}),
            **held_out,
        },
        staleness=(i - 1) - (trees[0].info.policy_version if trees else i - 1),
        idle=_idle(seconds, time.perf_counter() - began),
    )
    return Outcome(record, trees, metrics, stats, report)


def _draws(run: Run, i: int) -> IterationDraws:
    return draw_iteration(run.config.seed, i, len(run.train_tasks), run.config.prompts)


def _grow(run: Run, j: int, seconds: dict[str, float], say: Callable[[str], None]) -> RolloutResult:
    """Iteration ``j``'s trees on the weights the engines serve now; a prompt whose env
    failed is said, and counted (``dropped_prompts``), and the iteration goes on without it.
    An engine actor restarted since the last sync holds other weights than those: the engines
    load them from their checkpoint and the trees grow again (the same trees: every request
    has its seed), said; where no checkpoint holds them, the run stops with one line."""

    def roll_out() -> RolloutResult:
        return iteration.roll_out(
            run.serving_now,
            run.train_tasks,
            run.suite,
            run.predictor,
            run.config,
            j,
            _draws(run, j),
            run_id=run.run_id,
            model=run.model,
            tokenizer=run.tokenizer,
            session=run.session,
            policy_version=run.serving_version,
        )

    try:
        result = roll_out()
    except Exception as err:
        worker = sys.modules.get("trace_core.rollout.ray_worker")  # loaded with engine actors
        if worker is None or not isinstance(err, worker.StaleWeightsError):
            raise
        served, newest = run.serving_version, run.checkpointed
        if not served or newest != served:
            where = f"iteration {newest}'s checkpoint" if newest else "its start"
            raise EnginesLostError(
                f"an engine actor was restarted during the rollout of iteration {j} and lost "
                f"the weights of iteration {served}, which no checkpoint holds; run the same "
                f"command again: it resumes from {where}"
            ) from None
        # The folder it was written to; the one this run started from is the weights' start.
        started = served == run.started
        run.serving_now = (
            str(run.weights.start.policy) if started else f"{run.checkpoint_at(served)}/policy"
        )
        say(
            f"iteration {j}: an engine actor was restarted during its rollout: the engines load "
            f"iteration {served}'s weights from {run.serving_now} and the trees grow again"
        )
        result = roll_out()
    seconds["rollout"] = seconds.get("rollout", 0.0) + result.seconds
    for prompt, error in result.dropped:
        say(f"iteration {j}: prompt {prompt} dropped, its env failed: {error}")
    return result


def _fit_through(run: Run, through: int, seconds: dict[str, float]) -> list[FitReport]:
    """Fit the predictor on the trees of every iteration after the newest it has seen, up to
    ``through``, in order (each with its iteration's fit seed)."""
    reports = []
    while run.fitted_through < through:
        j = run.fitted_through + 1
        start = time.perf_counter()
        reports.append(iteration.fit_predictor(run.predictor, run.ahead[j].trees, _draws(run, j)))
        seconds["predictor"] = seconds.get("predictor", 0.0) + time.perf_counter() - start
        run.fitted_through = j
    return reports


def _idle(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """Seconds of the iteration's wall time the engines (neither rolling out nor evaluating)
    and the trainers (neither updating nor checkpointing) spent idle."""
    engines = wall - seconds.get("rollout", 0.0) - seconds.get("eval", 0.0)
    trainers = wall - seconds.get("update", 0.0) - seconds.get("checkpoint", 0.0)
    return {"engines": max(engines, 0.0), "trainers": max(trainers, 0.0)}


def fitted_after(done: int, config: TrainConfig) -> int:
    """The newest iteration whose trees the predictor saved after iteration ``done`` has
    been fitted on: ``done`` itself, or with k >= 1 the k - 1 grown ahead before it too."""
    return done + max(config.max_staleness - 1, 0) if done else 0


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
