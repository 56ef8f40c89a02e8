"""The local training loop: warm start, then K × (rollout → fit predictor → update policy),
evaluating on the held-out split as it goes.

    trace-rl train --task calc --strategy trace --iterations 12 --output build/train/calc-trace

Each iteration draws a fresh prompt pool from the train split, grows one budgeted tree per
rolled-out prompt with the current policy (``rollout.grow``), refits the shared predictor on
every tree seen so far, and takes a policy-gradient step on the new trees
(``policy.update``). An iteration is committed when its directory is complete:

    OUTPUT/
      config.json                  the run's config (what a resumed run is checked against)
      log.jsonl                    one line per iteration: rollout metrics, update stats, eval
      curves.png                   held-out accuracy and effective ratio vs generated tokens
      summary.md                   the run in Markdown, as the pipeline's report step writes it
      tensorboard/                 the log as TensorBoard event files (train.tracking)
      mlflow.json                  the run's MLflow run, with MLFLOW_TRACKING_URI set
      init/                        a remote --init (s3://), downloaded once
      warmstart/                   the warm-started policy (synthetic tasks without --init, or
                                   --init with --warmstart-init)
      iterations/0003/
        trees.parquet  metrics.json
        policy/                    HF checkpoint (loads in TorchEngine and vLLM)
        optimizer.safetensors      AdamW moments, so a resumed run continues the same update
        predictor/                 the success predictor after this iteration's fit
        manifest.json              every file above with its size and sha256, written last
      latest                       the last complete iteration, written last (atomic rename)

A run started again with the same output folder resumes after ``latest``: the crash of an
iteration half-way leaves ``latest`` on the one before, whose files are whole. A damaged
iteration is passed over for the newest complete one, and a folder of iterations without a
valid ``latest`` is refused rather than rebuilt (``train.run_folder``; ``--restart`` discards
the run). Every random
draw of iteration i comes from a generator seeded by (seed, i), so a resumed run samples what
an uninterrupted one would have.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trace_core.algo.metrics import BatchMetrics
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import TaskSuite
from trace_core.envs.suites import make_suite
from trace_core.policy.checkpoint import check_checkpoint
from trace_core.policy.model import (
    load_checkpoint,
    load_for_training,
    load_master,
)
from trace_core.policy.predictor import SharedPredictor
from trace_core.policy.update import load_optimizer, make_optimizer
from trace_core.rollout.engines import EngineSession
from trace_core.store.schema import write_trees
from trace_core.train import iteration
from trace_core.train.ahead import drop_ahead, keep_ahead, stored_ahead
from trace_core.train.base_model import fetch_model, local_path
from trace_core.train.config import TrainConfig, check_update_place
from trace_core.train.evaluate import ALL
from trace_core.train.phases import (
    Run,
    Save,
    fitted_after,
    iteration_line,
    run_iteration,
    start_record,
)
from trace_core.train.record import LOG, IterationRecord, read_log
from trace_core.train.run_folder import (
    CONFIG,
    RunFolderError,
    commit_iteration,
    discard_run,
    iteration_dir,
    move_latest,
    resume_point,
    write_atomic,
)
from trace_core.train.start_state import StartState
from trace_core.train.tracking import (
    MLFLOW_FILE,
    MlflowRun,
    TrackingError,
    failing,
    finish,
    log_files,
    log_records,
    open_mlflow,
    run_tags,
    tracking_uri,
    write_tensorboard,
)
from trace_core.train.warmstart import WarmstartReport, stored_warmstart, warmstart
from trace_core.train.weights import Weights

PREDICTOR = "predictor"
INIT = "init"
"""Where a remote ``init`` is downloaded inside the run folder."""


def train(
    config: TrainConfig,
    progress: Callable[[str], None] | None = None,
    suite: TaskSuite | None = None,
    restart: bool = False,
    label: tuple[str, Mapping[str, str]] = ("", {}),
) -> list[IterationRecord]:
    """Run (or resume) the loop; returns every iteration's record, the resumed ones included.

    ``suite`` replaces the one ``config.task`` names (tests bring their own envs). ``restart``
    discards the run already in ``config.output`` (``run_folder.discard_run``) instead of
    resuming it. Everything is checked before the folder is written: the suite, ``init``, the
    folder's iterations and its stored config. With ``MLFLOW_TRACKING_URI`` set, the run is
    logged to MLflow as it goes (``train.tracking``), under ``label``'s name (default: the
    output folder's) and with its tags.
    """
    say = progress or (lambda _message: None)
    out = config.output
    suite = suite or make_suite(config.task, config.data, config.seed, config.retriever_url)
    local_init = local_path(config.init) if config.init else None
    if local_init:  # a remote one is checked once downloaded
        check_checkpoint(local_init, "--init")
    if restart and (removed := discard_run(out)):
        say(f"--restart: discarded {', '.join(removed)} in {out}")
    point = resume_point(out)
    done = point.iteration
    for note in point.notes:
        say(f"{note}; resuming after iteration {done}, the newest checkpoint")
    _check_config(out, config, done)
    records = _resumed_log(out, done)
    tracked = _open_mlflow(out, config, records, label, say)
    with failing(tracked):
        records = _train(config, say, suite, out, done, records, local_init, tracked)
    plot_run(records, out / "curves.png")
    write_summary(out, config, records)
    if tracked is not None:
        try:
            log_records(tracked, records)
            log_files(tracked, [out / name for name in ("curves.png", SUMMARY, LOG, CONFIG)])
            finish(tracked)
        except TrackingError as err:  # the run folder is whole; running again logs the rest
            say(f"{err}; the run is done: run it again with the same --output to log the rest")
    return records


def _train(
    config: TrainConfig,
    say: Callable[[str], None],
    suite: TaskSuite,
    out: Path,
    done: int,
    records: list[IterationRecord],
    local_init: Path | None,
    tracked: MlflowRun | None,
) -> list[IterationRecord]:
    init = local_init or _fetch_init(config, say)  # a local one was checked above
    start_dir = init if init and not config.warmstart_init else out / "warmstart"
    if not done and start_dir == out / "warmstart":
        made = iteration.warmstart_config(config, start_dir, init)
        if stored_warmstart(start_dir, made, f"the run in {out}") is None:
            source = f" from {config.init}" if init else ""
            say(f"warm start of the {config.task} policy{source}")
            report = warmstart(made)
            if init:
                say(f"warm start: {_warmstart_line(report)}")
    policy_dir = iteration_dir(out, done) / "policy" if done else start_dir
    if done:
        say(f"resuming after iteration {done} from {policy_dir}")
    check_update_place(config.ray_address, config.train_workers, policy_dir)
    # fp32 master weights whatever the checkpoint holds; the engines get ``serving`` back.
    model, tokenizer, serving = load_for_training(policy_dir)
    if done:
        load_master(model, iteration_dir(out, done))
    reference = None
    if config.update.kl_coef > 0 and not config.train_workers:  # KL to the starting policy
        reference, _ = load_checkpoint(start_dir)
    fmt = iteration.turn_format(config, suite, tokenizer)
    optimizer = make_optimizer(model, config.update)
    predictor = iteration.new_predictor(config, tokenizer)
    if done:
        load_optimizer(optimizer, iteration_dir(out, done) / "optimizer.safetensors")
        predictor = SharedPredictor.load(iteration_dir(out, done) / PREDICTOR, tokenizer)
    start = StartState(
        str(policy_dir),
        optimizer=str(iteration_dir(out, done) / "optimizer.safetensors") if done else None,
        master=str(iteration_dir(out, done)) if done else None,
        reference=str(start_dir) if config.update.kl_coef > 0 else None,
    )
    # Ray engine pools and vLLM start once and take each new policy in place; evaluation runs
    # on them too, so the next rollout finds the policy it evaluated already loaded.
    with (
        Weights(config, model, serving, start, out.name) as weights,
        EngineSession(config.engine, config.ray_address, placement=weights.placement) as session,
    ):
        run = Run(
            config, out.name, suite, suite.tasks("train"), iteration.eval_tasks(suite, config),
            fmt, model, tokenizer, serving, optimizer, reference, predictor, weights, session,
            serving_now=str(policy_dir), checkpointed=done, started=done,
            checkpoint_at=lambda i: str(iteration_dir(out, i)),
            total_tokens=records[-1].total_tokens if records else 0, serving_version=done,
            ahead=stored_ahead(out, done, config, say), fitted_through=fitted_after(done, config),
            keep_ahead=lambda j, trees: keep_ahead(out, j, trees),
        )  # fmt: skip
        if not records:
            say(f"evaluating the starting policy on {len(run.eval_tasks)} held-out tasks")
            records = [start_record(run, policy_dir)]
            _append_log(out, records[0], tracked, say, fresh=True)

        def persist(
            i: int, trees: Sequence[RolloutTree], metrics: BatchMetrics, save: Save | None
        ) -> None:
            # The folder first (its policy is what a kept engine evaluates), then the log line
            # with the evaluation, then ``latest``: until then a crash leaves iteration i to redo.
            _write_iteration(out, i, save, predictor, trees, metrics)
            drop_ahead(out, i)  # its trees are the iteration's now

        for i in range(done + 1, config.iterations + 1):
            outcome = run_iteration(run, i, persist, say)
            _append_log(out, outcome.record, tracked, say)
            move_latest(out, i)
            records.append(outcome.record)
            say(iteration_line(config, outcome))
    return records


def _fetch_init(config: TrainConfig, say: Callable[[str], None]) -> Path | None:
    """A remote ``config.init``'s download into the run's ``init/`` (made once, then checked)."""
    if not config.init:
        return None
    folder = config.output / INIT
    if not folder.exists():
        say(f"downloading {config.init} to {folder}")
    return fetch_model(config.init, folder)


def _warmstart_line(report: WarmstartReport) -> str:
    return (
        f"action parse rate {report.parse_rate_before:.3f} → {report.parse_rate:.3f}, held-out "
        f"success {report.success_all_before:.3f} → {report.success_all:.3f} "
        f"({report.steps} steps, final loss {report.final_loss:.3f})"
    )


# --- run folder ------------------------------------------------------------------------
def _check_config(out: Path, config: TrainConfig, done: int) -> None:
    """Write config.json for a new run; where the folder already holds a run (an iteration or
    a warm start), refuse a different config (a field the stored config predates counts as its
    default)."""
    path = out / CONFIG
    current = config.to_json()
    if path.exists() and (done or (out / "warmstart").exists()):
        try:
            stored = {**TrainConfig().to_json(), **json.loads(path.read_text())}
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
            raise RunFolderError(f"{path}: not a run config ({err}); pass --restart") from None
        changed = sorted(
            k for k in current if k not in ("iterations", "output") and stored.get(k) != current[k]
        )
        if changed:
            raise RunFolderError(
                f"{out} holds a run with a different config ({', '.join(changed)}); "
                "use another --output, the same settings, or --restart to discard it"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(current, indent=2) + "\n")


def _resumed_log(out: Path, done: int) -> list[IterationRecord]:
    """The log's records of iterations 0..done (later lines are a crashed iteration's)."""
    if not done:
        return []
    records = read_log(out)[: done + 1]
    if [r.iteration for r in records] != list(range(done + 1)):
        raise RunFolderError(
            f"{out / LOG}: does not hold iterations 0..{done} in order; the run cannot go on "
            "from it: pass --restart, or choose another --output"
        )
    return records


def _write_iteration(
    out: Path,
    i: int,
    save: Save | None,
    predictor: SharedPredictor,
    trees: Sequence[RolloutTree],
    metrics: BatchMetrics,
) -> None:
    """Write iteration i's folder in full (with its manifest); it counts as done once its log
    line is written and ``latest`` moves to it. ``save``: write the checkpoint into it (the
    policy in its serving dtype, the optimizer state and the fp32 master weights beside it when
    that dtype rounds them: ``Weights.saver``), on a checkpoint iteration."""

    def write(staging: Path) -> None:
        write_trees(staging / "trees.parquet", trees)
        (staging / "metrics.json").write_text(json.dumps(metrics.as_dict(), indent=2) + "\n")
        if save is not None:
            save(staging)
        predictor.save(staging / PREDICTOR)

    commit_iteration(out, i, write)


def _append_log(
    out: Path,
    record: IterationRecord,
    tracked: MlflowRun | None,
    say: Callable[[str], None],
    fresh: bool = False,
) -> None:
    """Rewrite the log up to this record's iteration (a crashed run may have left a later line),
    its TensorBoard files, and log what MLflow does not hold yet. An MLflow call that fails
    costs no training: it is said, and the next iteration's catches up."""
    path = out / LOG
    kept = [] if fresh else [r for r in read_log(out) if r.iteration < record.iteration]
    lines = [json.dumps(asdict(r)) for r in [*kept, record]]
    write_atomic(path, "\n".join(lines) + "\n")
    write_tensorboard(out, [*kept, record])  # beside it: tensorboard --logdir OUT
    if tracked is not None:
        try:
            log_records(tracked, [*kept, record])
        except TrackingError as err:
            say(f"{err}; the next iteration logs it again")


def _open_mlflow(
    out: Path,
    config: TrainConfig,
    records: Sequence[IterationRecord],
    label: tuple[str, Mapping[str, str]],
    say: Callable[[str], None],
) -> MlflowRun | None:
    """The run's MLflow run when ``MLFLOW_TRACKING_URI`` is set: the one ``mlflow.json`` names
    (a resumed run) if that server still holds it, else a new one; the resumed iterations are
    logged at once. Fails before any training when the server cannot be used."""
    uri = tracking_uri()
    if not uri:
        return None
    stored = MlflowRun.read(out / MLFLOW_FILE)
    name, tags = label
    tags = {**run_tags(config), **tags}
    same = stored is not None and stored.uri == uri
    run = open_mlflow(uri, name or out.name, config.to_json(), tags,
                      run_id=stored.run_id if stored and same else None)  # fmt: skip
    write_atomic(out / MLFLOW_FILE, run.to_json())
    verb = "continuing" if same and stored and stored.run_id == run.run_id else "logging to"
    say(f"MLflow: {verb} run {run.run_id} at {uri}")
    log_records(run, records)
    return run


# --- pieces ------------------------------------------------------------------------------
SUMMARY = "summary.md"


def write_summary(out: Path, config: TrainConfig, records: Sequence[IterationRecord]) -> None:
    """``summary.md``: the run's settings, accuracy before and after, one line per iteration,
    the commands that open its trees (``train.report``), once an iteration has trees."""
    from trace_core.train.report import summary_markdown

    evals = [r.eval for r in records if r.eval]
    last = records[-1].iteration
    if last == 0 or not evals:
        return
    trees = {r.iteration: iteration_dir(out, r.iteration) / "trees.parquet" for r in records[1:]}
    text = summary_markdown(
        title=f"TRACE run {out.name}",
        settings={
            "task": config.task, "strategy": config.strategy, "M (roots)": config.budget,
            "N (continuations)": config.continuations, "iterations": last, "seed": config.seed,
        },
        records=records, start_eval=evals[0], final_eval=evals[-1], trees_path=trees[last],
        tree_uris={i: str(path) for i, path in trees.items()},
    )  # fmt: skip
    write_atomic(out / SUMMARY, text)


def plot_run(records: Sequence[IterationRecord], path: Path) -> None:
    """Held-out accuracy and the prompt effective ratio against generated rollout tokens; and,
    where the records hold them, the engines' and trainers' idle seconds and the update's
    staleness per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in records if r.eval]
    scheduled = [r for r in records[1:] if r.idle]
    fig, axes = plt.subplots(1, 3 if scheduled else 2, figsize=(15 if scheduled else 10, 3.8))
    left, right = axes[0], axes[1]
    if scheduled:
        _plot_schedule(axes[2], scheduled)
    tokens = [r.total_tokens / 1000 for r in evals]
    for key, label in (("mean_k", "mean@k"), ("pass1", "pass@1 (greedy)")):
        if all(r.eval[key] for r in evals):  # type: ignore[index]  # mean@k: none when k = 0
            left.plot(tokens, [r.eval[key][ALL] for r in evals], marker="o", label=label)  # type: ignore[index]
    left.set(xlabel="generated rollout tokens (thousands)", ylabel="held-out success")
    trained = records[1:]
    right.plot(
        [r.total_tokens / 1000 for r in trained],
        [r.rollout["prompt_effective_ratio"] for r in trained],
        marker=".",
    )
    right.set(
        xlabel="generated rollout tokens (thousands)",
        ylabel="prompt effective ratio",
        ylim=(0, 1.02),
    )
    strategy_name = records[0].strategy if records else ""
    what = (
        "held-out accuracy, reward contrast and the schedule"
        if scheduled
        else ("held-out accuracy and reward contrast")
    )
    fig.suptitle(f"{strategy_name}: {what}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_schedule(ax: Any, records: Sequence[IterationRecord]) -> None:
    """Idle seconds of the engines and the trainers per iteration, staleness on the right."""
    steps = [r.iteration for r in records]
    for part, marker in (("engines", "o"), ("trainers", "s")):
        ax.plot(steps, [r.idle.get(part, 0.0) for r in records], marker=marker, label=part)
    ax.set(xlabel="iteration", ylabel="idle seconds")
    ax.legend(loc="upper left")
    stale = ax.twinx()
    stale.step(steps, [r.staleness for r in records], where="mid", color="grey", alpha=0.6)
    top = max([r.staleness for r in records] + [1])
    stale.set(ylabel="staleness (versions)", ylim=(-0.1, top + 0.5), yticks=range(top + 1))
