"""A run's figures where a team's tracking tools read them: TensorBoard event files beside the
run's log, and, when ``MLFLOW_TRACKING_URI`` is set, an MLflow run.

    write_tensorboard(folder, records)    # folder/tensorboard/, from the whole log
    run = open_mlflow(uri, name, params, key=..., run_id=...)   # the training run's MLflow run
    log_records(run, records)             # every iteration it does not hold yet
    log_files(run, [curves, report])      # artifacts; finish(run) when the run is done

``trace-rl train`` writes them into its run folder after every iteration, the pipeline's steps
into each state folder beside its ``log.jsonl``; ``tensorboard --logdir FOLDER`` shows them, side
by side with a team's other runs. The files are written from the log each time, so a resumed
run's curves continue its earlier iterations', and they are replaced whole (a new folder, then a
rename), never left half-written.

Each iteration is one step (``global_step`` = iteration; 0 is the starting policy's
evaluation). The tags (``figures``): ``eval/`` held-out accuracy and parse rate, ``rollout/``
effective ratios, mixed groups, units and tokens, ``update/`` loss, KL, logprob gap, gradient
norm and clip fraction, ``predictor/`` its skills and fit, ``seconds/`` each phase's wall time,
``schedule/`` the update's staleness and the engines' and trainers' idle seconds, ``storage/``
a pipeline step's S3 bytes and checkpoint bytes.

MLflow gets the same figures as metrics (step = iteration), the run's config as parameters
(nested fields joined by dots: ``update.lr``), and the plots and reports as artifacts: one MLflow
run per training run, in the experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``trace``). A
resumed training run continues its MLflow run: ``trace-rl train`` keeps its id in the run
folder (``mlflow.json``), the pipeline in its state and, for a named run, finds it by the tag
``trace.run``. Logging is idempotent: ``log_records`` sends only the iterations the MLflow run
does not hold yet (it reads back the ``iteration`` metric), so a step retried, a resumed run,
or an iteration whose logging failed is caught up by the next call, never logged twice.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_core.train.record import IterationRecord

if TYPE_CHECKING:
    from trace_core.train.config import TrainConfig

TENSORBOARD = "tensorboard"
"""The event files' folder, inside the folder that holds ``log.jsonl``."""

ROLLOUT = (
    "prompt_effective_ratio",
    "anchor_effective_ratio",
    "mixed_groups",
    "mixed_per_100_units",
    "units",
    "contrast_pairs",
    "dropped_prompts",
)
UPDATE = ("loss", "kl", "logprob_gap", "logprob_gap_max", "grad_norm", "clip_fraction", "paths")
PREDICTOR = ("root_skill", "prefix_skill", "eval_root_skill", "loss_after", "rows")
STORAGE = ("s3_bytes", "checkpoint_bytes")

MLFLOW_URI = "MLFLOW_TRACKING_URI"
MLFLOW_EXPERIMENT = "MLFLOW_EXPERIMENT_NAME"
EXPERIMENT = "trace"
"""The MLflow experiment when ``MLFLOW_EXPERIMENT_NAME`` is unset."""
MLFLOW_FILE = "mlflow.json"
"""``trace-rl train``'s MLflow run, in its run folder: what a resumed run continues."""
RUN_KEY = "trace.run"
"""The tag a named run is found again by."""
STEP = "iteration"
"""The metric whose steps say which iterations an MLflow run holds."""


def figures(record: IterationRecord) -> dict[str, float]:
    """The iteration's figures by TensorBoard tag (absent or non-finite ones left out)."""
    out: dict[str, float] = {}
    if record.eval:
        report = record.eval
        out["eval/pass1"] = _all(report.get("pass1"))
        out[f"eval/mean_at_{report.get('k', 'k')}"] = _all(report.get("mean_k"))
        out["eval/parse_rate"] = _number(report.get("parse_rate"))
    if record.iteration > 0:
        out["rollout/tokens"] = float(record.tokens)
        out["rollout/total_tokens"] = float(record.total_tokens)
    out |= _picked("rollout", record.rollout, ROLLOUT)
    out |= _picked("update", record.update, UPDATE)
    out |= _picked("predictor", record.predictor, PREDICTOR)
    out |= _picked("storage", record.storage, STORAGE)
    out |= {f"seconds/{phase}": float(s) for phase, s in record.seconds.items()}
    if record.iteration > 0:
        out["schedule/staleness"] = float(record.staleness)
        out |= {f"schedule/{part}_idle_seconds": float(s) for part, s in record.idle.items()}
    return {tag: value for tag, value in out.items() if math.isfinite(value)}


def write_tensorboard(folder: Path, records: Sequence[IterationRecord]) -> Path:
    """Write ``records`` as ``folder/tensorboard/``'s one event file; returns that folder."""
    from tensorboardX import SummaryWriter

    target = folder / TENSORBOARD
    fresh = Path(tempfile.mkdtemp(prefix=f".{TENSORBOARD}.", dir=folder))
    try:
        with SummaryWriter(logdir=str(fresh)) as writer:
            for record in records:
                for tag, value in figures(record).items():
                    writer.add_scalar(tag, value, global_step=record.iteration)
        if target.exists():
            shutil.rmtree(target)
        fresh.rename(target)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return target


def _picked(prefix: str, values: Mapping[str, object], keys: Sequence[str]) -> dict[str, float]:
    return {f"{prefix}/{k}": _number(values[k]) for k in keys if k in values}


def _all(values: object) -> float:
    return _number(values.get("all")) if isinstance(values, Mapping) else math.nan


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


# --- MLflow ----------------------------------------------------------------------------------
class TrackingError(RuntimeError):
    """The MLflow server could not be reached or refused a call; the message names the URI."""


@dataclass(frozen=True)
class MlflowRun:
    """A training run's MLflow run: the server and the run's id."""

    uri: str
    run_id: str

    def to_json(self) -> str:
        return json.dumps({"tracking_uri": self.uri, "run_id": self.run_id}, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> MlflowRun | None:
        """The run stored in ``path``, or None when there is none (or not a readable one)."""
        try:
            body = json.loads(path.read_text())
            return cls(str(body["tracking_uri"]), str(body["run_id"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def tracking_uri(given: str = "") -> str:
    """The MLflow server to log to: ``given`` (a pipeline parameter), else ``MLFLOW_TRACKING_URI``;
    empty: no MLflow logging."""
    return given.strip() or os.environ.get(MLFLOW_URI, "").strip()


def open_mlflow(
    uri: str,
    name: str,
    params: Mapping[str, object],
    tags: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
    key: str = "",
) -> MlflowRun:
    """The training run's MLflow run on ``uri``: ``run_id``'s if the server still holds it, else
    the newest one tagged ``trace.run`` = ``key`` (a named run), else a new one named ``name``.
    It is (again) RUNNING, and holds every parameter of ``params`` (flattened); a parameter it
    already holds keeps its first value (MLflow's parameters are immutable). Raises
    ``TrackingError`` naming the URI when the server cannot be used."""
    from mlflow.entities import Param, RunTag

    client = _client(uri)
    with _calls(uri, "open a run"):
        run = _existing(client, run_id, key)
        if run is None:
            labels = {**(tags or {}), **({RUN_KEY: key} if key else {})}
            run = client.create_run(_experiment(client), tags=labels, run_name=name)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            if tags:
                client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        held = run.data.params
        new = [Param(k, v) for k, v in flat_params(params).items() if k not in held]
        for start in range(0, len(new), 100):  # MLflow takes 100 parameters a call
            client.log_batch(run.info.run_id, params=new[start : start + 100])
    return MlflowRun(uri, run.info.run_id)


def log_records(run: MlflowRun, records: Sequence[IterationRecord]) -> int:
    """Log the figures of every record whose iteration ``run`` does not hold yet; returns how
    many iterations were logged."""
    from mlflow.entities import Metric

    client = _client(run.uri)
    with _calls(run.uri, "log metrics"):
        held = {m.step for m in client.get_metric_history(run.run_id, STEP)}
        now = int(time.time() * 1000)
        batch: list[Any] = []
        logged = 0
        for record in (r for r in records if r.iteration not in held):
            step = record.iteration
            values = [*figures(record).items(), (STEP, float(step))]  # the step marker last
            if len(batch) + len(values) > 1000:  # MLflow takes 1000 metrics a call
                client.log_batch(run.run_id, metrics=batch)
                batch = []
            batch += [Metric(tag, value, now, step) for tag, value in values]
            logged += 1
        if batch:
            client.log_batch(run.run_id, metrics=batch)
    return logged


def log_files(run: MlflowRun, paths: Sequence[Path], folder: str | None = None) -> None:
    """Upload each existing file (or folder) of ``paths`` as an artifact of ``run``."""
    client = _client(run.uri)
    with _calls(run.uri, "upload artifacts"):
        for path in paths:
            if path.exists():
                client.log_artifact(run.run_id, str(path), folder)


def finish(run: MlflowRun, status: str = "FINISHED") -> None:
    with _calls(run.uri, "end the run"):
        _client(run.uri).set_terminated(run.run_id, status)


def running(run: MlflowRun) -> None:
    """``run`` RUNNING again (after a step that failed was retried)."""
    with _calls(run.uri, "mark the run running"):
        _client(run.uri).update_run(run.run_id, status="RUNNING")


@contextmanager
def failing(run: MlflowRun | None) -> Iterator[None]:
    """Mark ``run`` FAILED (best effort) when the block raises; the error goes on."""
    try:
        yield
    except BaseException:
        if run is not None:
            with suppress(TrackingError):
                finish(run, "FAILED")
        raise


def run_tags(config: TrainConfig) -> dict[str, str]:
    """What every training run's MLflow run is tagged with: its task, strategy and seed."""
    return {
        "trace.task": config.task,
        "trace.strategy": config.strategy,
        "trace.seed": str(config.seed),
    }


def flat_params(values: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """Nested config fields as MLflow parameters: ``{"update": {"lr": 1e-4}}`` is ``update.lr``."""
    out: dict[str, str] = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            out |= flat_params(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = "" if v is None else str(v)[:6000]
    return out


def _client(uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise TrackingError(
            f"{MLFLOW_URI} is set ({uri}) but mlflow is not installed: pip install mlflow-skinny"
        ) from None
    return MlflowClient(tracking_uri=uri)


@contextmanager
def _calls(uri: str, what: str) -> Iterator[None]:
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingError(f"MLflow at {uri} ({MLFLOW_URI}): could not {what}: {first}") from err


def _experiment(client: Any) -> str:
    name = os.environ.get(MLFLOW_EXPERIMENT, "").strip() or EXPERIMENT
    from mlflow.exceptions import MlflowException

    for _ in range(2):  # two runs may create it at once: the loser reads the winner's
        found = client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(client.create_experiment(name))
        except MlflowException:
            continue
    raise TrackingError(f"MLflow: could not create or find the experiment {name!r}")


def _existing(client: Any, run_id: str | None, key: str) -> Any:
    from mlflow.exceptions import MlflowException

    if run_id:
        try:
            run = client.get_run(run_id)
            if run.info.lifecycle_stage == "active":
                return run
        except MlflowException:  # gone from this server: a new run
            pass
    if key:
        if not key.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"MLflow run key {key!r}: letters, digits, '.', '_', '-' only")
        found = client.search_runs(
            [_experiment(client)],
            filter_string=f"tags.`{RUN_KEY}` = '{key}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if found:
            return found[0]
    return None
