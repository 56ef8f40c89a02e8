"""A pipeline run's MLflow run (``train.tracking``), carried from step to step in the state.

    run_id = open_tracking(config, records)     # the session's first step: a new run, or the
                                                # named run's (``run_name``) to continue
    log_tracking(config, run_id, records)       # each iteration's step
    end_tracking(config, state_dir, records, {"report.html": path, ...})
                                                # the report step: artifacts, FINISHED
    with marks_failed(config, state_dir): ...   # a step that raises: the MLflow run FAILED

The server is the ``mlflow_tracking_uri`` parameter, else the steps' ``MLFLOW_TRACKING_URI``;
with neither, every call here does nothing. Only the first step fails when the server cannot be
used; after it, a failed call is printed and the next step's catches up.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from trace_core.train.contract import PipelineConfig
from trace_core.train.record import IterationRecord
from trace_core.train.tracking import (
    MlflowRun,
    TrackingError,
    failing,
    finish,
    log_files,
    log_records,
    open_mlflow,
    run_tags,
    running,
    tracking_uri,
)


def open_tracking(config: PipelineConfig, records: Sequence[IterationRecord]) -> str | None:
    """The run's MLflow run id (None without a server), with ``records`` logged."""
    uri = tracking_uri(config.tracking_uri)
    if not uri:
        return None
    params = {**config.train.to_json(), "run_name": config.run_name, "store": config.store}
    tags = {**run_tags(config.train), "trace.session": config.engine_name}
    name = config.run_name or config.engine_name or "pipeline"
    run = open_mlflow(uri, name, params, tags, key=config.run_name)
    log_records(run, records)
    print(f"MLflow: run {run.run_id} at {uri}", flush=True)
    return run.run_id


def log_tracking(
    config: PipelineConfig, run_id: str | None, records: Sequence[IterationRecord]
) -> None:
    """Log the iterations the MLflow run does not hold yet; the run is RUNNING (again, after a
    step that failed and was retried)."""
    if run_id and (uri := tracking_uri(config.tracking_uri)):
        try:
            running(MlflowRun(uri, run_id))
            log_records(MlflowRun(uri, run_id), records)
        except TrackingError as err:
            print(f"{err}; the next step logs it again", flush=True)


def end_tracking(
    config: PipelineConfig,
    state_dir: Path,
    records: Sequence[IterationRecord],
    files: Mapping[str, Path],
) -> None:
    """The report step: the last iterations, the report's files (under the names ``files``
    gives them) and the run's curves (``curves.png``) as artifacts, then FINISHED."""
    run_id = _state_run(state_dir)
    if not (run_id and (uri := tracking_uri(config.tracking_uri))):
        return
    from trace_core.train.loop import plot_run

    run = MlflowRun(uri, run_id)
    with tempfile.TemporaryDirectory(prefix="trace-report-") as scratch:
        named = [Path(scratch, name) for name in files]
        for path, source in zip(named, files.values(), strict=True):
            shutil.copyfile(source, path)
        plot_run(records, Path(scratch, "curves.png"))
        try:
            log_records(run, records)
            log_files(run, [*named, Path(scratch, "curves.png")])
            finish(run)
        except TrackingError as err:
            print(f"{err}; the report is in the run's KFP artifacts all the same", flush=True)


@contextmanager
def marks_failed(config: PipelineConfig, state_dir: Path | None) -> Iterator[None]:
    """A step on the state in ``state_dir`` that raises marks the run's MLflow run FAILED (the
    step retried, or the run resumed, sets it RUNNING again); the error goes on."""
    run_id = _state_run(state_dir) if state_dir is not None else None
    uri = tracking_uri(config.tracking_uri)
    with failing(MlflowRun(uri, run_id) if run_id and uri else None):
        yield


def _state_run(state_dir: Path) -> str | None:
    """The MLflow run id the state carries (``RunState.mlflow_run``)."""
    try:
        run = json.loads((state_dir / "state.json").read_text()).get("mlflow_run")
    except (OSError, ValueError, AttributeError):
        return None
    return str(run) if run else None
