"""A training run logged to a real MLflow tracking server (``mlflow_uri``, tests/conftest.py)
and read back through MLflow's client, beside the TensorBoard files read back with TensorBoard's
reader; its resume continues the same MLflow run; a server that cannot be reached stops the run
before it trains. The pipeline's steps: tests/train/test_session.py; a comparison's arms:
tests/test_cli_commands.py."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from support import parity
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_core.train.contract import PipelineParameters
from trace_core.train.loop import train
from trace_core.train.record import IterationRecord
from trace_core.train.steps.session import STATE, RunState
from trace_core.train.steps.tracked import log_tracking, marks_failed, open_tracking
from trace_core.train.tracking import MLFLOW_FILE, TrackingError

pytestmark = pytest.mark.cluster  # a server started by the test session


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(init: Path, out: Path, iterations: int) -> list[IterationRecord]:
    return train(parity.tiny(init, out, iterations), suite=parity.ParitySuite())  # type: ignore[arg-type]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_run_is_logged_to_mlflow_and_tensorboard_and_its_resume_continues_it(
    init: Path, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "loop")
    out = tmp_path / "calc-trace"
    run(init, out, iterations=1)
    first = json.loads((out / MLFLOW_FILE).read_text())
    records = run(init, out, iterations=2)  # resumed: the same MLflow run goes on

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("loop")
    assert experiment is not None
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.info.run_id == first["run_id"] and logged.info.run_name == "calc-trace"
    assert logged.info.status == "FINISHED"
    params, tags = logged.data.params, logged.data.tags
    assert (params["strategy"], params["budget"], params["update.lr"]) == ("trace", "6", "0.01")
    assert (tags["trace.task"], tags["trace.strategy"], tags["trace.seed"]) == (
        "calc",
        "trace",
        "0",
    )
    # Every iteration once, the resumed ones included, with the log's figures.
    run_id = logged.info.run_id
    assert history(client, run_id, "iteration") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    pass1 = [(r.iteration, pytest.approx(r.eval["pass1"]["all"])) for r in records]  # type: ignore[index]
    assert history(client, run_id, "eval/pass1") == pass1
    ratio = [(r.iteration, pytest.approx(r.rollout["prompt_effective_ratio"])) for r in records[1:]]
    assert history(client, run_id, "rollout/prompt_effective_ratio") == ratio
    loss = [(r.iteration, pytest.approx(r.update["loss"])) for r in records[1:]]
    assert history(client, run_id, "update/loss") == loss
    # The plot, the log and the config as artifacts; the log is the run folder's.
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"curves.png", "summary.md", "log.jsonl", "config.json"} <= names
    log = client.download_artifacts(run_id, "log.jsonl", str(tmp_path))
    assert Path(log).read_text() == (out / "log.jsonl").read_text()
    # TensorBoard, beside the log, has the same figures.
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/pass1")] == [
        (step, value) for step, value in history(client, run_id, "eval/pass1")
    ]


def test_a_server_that_cannot_be_reached_stops_the_run_before_it_trains(
    init: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "run"
    with pytest.raises(TrackingError, match=re.escape(uri) + ".*MLFLOW_TRACKING_URI"):
        run(init, out, iterations=1)
    assert not (out / "iterations").exists() and not (out / MLFLOW_FILE).exists()


def test_a_failed_pipeline_step_marks_the_mlflow_run_failed_and_its_retry_running_again(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "steps")
    config = PipelineParameters(mlflow_tracking_uri=mlflow_uri).config()
    start = IterationRecord(0, "trace", 0, 0, {}, {}, {"k": 1, "pass1": {"all": 0.5}}, {})
    run_id = open_tracking(config, [start])
    state = RunState(0, 0, "policy", None, None, None, "", "steps", mlflow_run=run_id)
    (tmp_path / STATE).write_text(state.to_json())
    client = MlflowClient(tracking_uri=mlflow_uri)
    with pytest.raises(RuntimeError, match="trainer lost"), marks_failed(config, tmp_path):
        raise RuntimeError("trainer lost")
    assert client.get_run(run_id).info.status == "FAILED"
    first = IterationRecord(1, "trace", 5, 5, {"prompt_effective_ratio": 0.5}, {}, None, {})
    log_tracking(config, run_id, [start, first])  # the step, retried, got through
    assert client.get_run(run_id).info.status == "RUNNING"
    assert history(client, run_id, "iteration") == [(0, 0.0), (1, 1.0)]
