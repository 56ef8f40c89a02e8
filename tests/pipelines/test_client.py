"""``pipelines.client`` and ``trace-rl pipeline upload|run|schedule|runs`` over real HTTP.

The real ``kfp.Client`` talks to a stand-in server on 127.0.0.1 (``kfp_standin.py``) that
answers the KFP v2beta1 REST paths the SDK calls for these operations, keeps just enough state
(pipelines, versions, experiments, runs) to answer follow-up calls, and records every request. The
tests assert the method, path, query and body the SDK sent. This checks *our* calls (that the
right SDK methods get the right arguments, and what they put on the wire), not KFP itself: the
stand-in accepts what the real API server might reject (unknown parameters, a bad cron), and
nothing here runs a pipeline.
"""

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import kfp
import pytest
from kfp import compiler, dsl
from support.kfp_standin import API, StandIn, serving
from typer.testing import CliRunner

from pipelines.client import (
    DEFAULT_PACKAGE,
    RUN_NAME_PARAM,
    Server,
    SubmitError,
    build_params,
    check_cron,
    connect,
    read_package,
    resolve,
    run,
    runs,
    schedule,
    upload,
)
from pipelines.trace_training import PipelineOptions
from trace_core.cli import app

TOKEN = "s3cr3t-t0ken-value"


@pytest.fixture
def kfp_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    """A stand-in KFP API on a free port of 127.0.0.1, served by a thread for this test."""
    # kfp.Client reads (and may write) ~/.config/kfp/context.json: keep it to this test.
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    for name in ("KFP_HOST", "KF_PIPELINES_ENDPOINT", "KFP_TOKEN", "KFP_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    with serving(StandIn()) as state:
        yield state


# --- a real compiled package with the run_name parameter ---------------------------------------


@dsl.component(base_image="python:3.11-slim")
def _echo(run_name: str, iterations: int, lr: float) -> str:
    return f"{run_name}:{iterations}:{lr}"


@dsl.pipeline(name="trace-training-test")
def _tiny_pipeline(run_name: str, iterations: int = 4, lr: float = 2e-4, resume: bool = True):
    _echo(run_name=run_name, iterations=iterations, lr=lr)


@pytest.fixture(scope="module")
def package_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("package") / "pipeline.yaml"
    compiler.Compiler().compile(_tiny_pipeline, str(path))
    return path


# --- package parameters ----------------------------------------------------------------------


def test_params_are_typed_by_the_package(package_path: Path) -> None:
    package = read_package(package_path)
    assert package.name == "trace-training-test"
    assert package.parameters[RUN_NAME_PARAM].required
    assert not package.parameters["iterations"].required  # it has a default
    params = build_params(package, ["iterations=7", "lr=0.001", "resume=false"], "nightly")
    assert params == {"run_name": "nightly", "iterations": 7, "lr": 0.001, "resume": False}


@pytest.mark.parametrize(
    ("assignments", "run_name", "names"),
    [
        (["epochs=3"], "nightly", "--param epochs"),  # not a pipeline parameter
        (["iterations=three"], "nightly", "--param iterations"),  # not an integer
        (["resume=yes"], "nightly", "--param resume"),  # not a boolean
        (["iterations"], "nightly", "--param 'iterations'"),  # no '='
        (["run_name=x"], "nightly", "--param run_name"),  # belongs in --run-name
        ([], "../escape", "--run-name"),  # not a checkpoint run name
    ],
)
def test_param_errors_name_the_flag(
    package_path: Path, assignments: list[str], run_name: str, names: str
) -> None:
    with pytest.raises(SubmitError, match=re.escape(names)):
        build_params(read_package(package_path), assignments, run_name)


def test_a_package_without_run_name_is_refused(tmp_path: Path) -> None:
    @dsl.pipeline(name="no-run-name")
    def plain(iterations: int = 4):
        _echo(run_name="x", iterations=iterations, lr=0.1)

    path = tmp_path / "plain.yaml"
    compiler.Compiler().compile(plain, str(path))
    with pytest.raises(SubmitError, match="no 'run_name' parameter"):
        build_params(read_package(path), [], "nightly")


def test_the_committed_pipeline_resumes_by_run_name() -> None:
    package = read_package(DEFAULT_PACKAGE)
    assert package.name == "trace-training"
    assert package.parameters[RUN_NAME_PARAM].type == "STRING"
    # The package keeps runs in KFP's store by default; emptied, a named run is refused.
    assert package.parameters["store_uri"].default == PipelineOptions().store_uri
    with pytest.raises(SubmitError, match="--param store_uri: needed with a run name"):
        build_params(package, ["store_uri="], "nightly")
    params = build_params(
        package,
        ["store_uri=s3://mlpipeline/trace", "budget=64", 'gpu_node_selector={"gpu": "h100"}'],
        "nightly",
    )
    assert params == {
        "run_name": "nightly",
        "store_uri": "s3://mlpipeline/trace",
        "budget": 64,
        "gpu_node_selector": {"gpu": "h100"},
    }


def test_cron_needs_six_fields() -> None:
    assert check_cron("0  0 3 * * *") == "0 0 3 * * *"
    with pytest.raises(SubmitError, match=r"--cron '0 3 \* \* \*': KFP needs 6 fields"):
        check_cron("0 3 * * *")


def test_host_is_required_and_token_never_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KFP_HOST", "KF_PIPELINES_ENDPOINT", "KFP_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SubmitError, match="--host"):
        Server.from_env()
    monkeypatch.setenv("KFP_HOST", "http://kfp.example:8888/")
    monkeypatch.setenv("KFP_TOKEN", TOKEN)
    server = Server.from_env()
    assert (server.host, server.token) == ("http://kfp.example:8888", TOKEN)
    assert TOKEN not in repr(server)


# --- the SDK over HTTP -----------------------------------------------------------------------


def test_upload_new_pipeline_then_a_new_version(kfp_api: StandIn, package_path: Path) -> None:
    server = Server(kfp_api.url, TOKEN)
    client = connect(server)
    package = read_package(package_path)

    first = upload(client, server, package, name="trace-training")
    assert first.new_pipeline
    assert kfp_api.calls() == [
        ("GET", f"{API}/pipelines"),  # is the name taken? (filter on display_name)
        ("POST", f"{API}/pipelines/upload"),
        ("GET", f"{API}/pipelines/{first.pipeline_id}/versions"),  # the first version's id
    ]
    lookup = kfp_api.last("GET", f"{API}/pipelines")
    assert json.loads(lookup.query["filter"])["predicates"] == [
        {"operation": 1, "key": "display_name", "stringValue": "trace-training"}  # 1: EQUALS
    ]
    sent = kfp_api.last("POST", f"{API}/pipelines/upload")
    assert sent.query["name"] == "trace-training"
    filename, content = sent.files["uploadfile"]
    assert filename == "pipeline.yaml"
    assert content == package_path.read_bytes()
    assert sent.headers["authorization"] == f"Bearer {TOKEN}"

    second = upload(client, server, package, name="trace-training", version="v2")
    assert not second.new_pipeline
    assert second.pipeline_id == first.pipeline_id
    assert second.version_name == "v2"
    sent = kfp_api.last("POST", f"{API}/pipelines/upload_version")
    assert sent.query == {"name": "v2", "pipelineid": first.pipeline_id}
    assert sent.files["uploadfile"][1] == package_path.read_bytes()
    assert second.version_id == kfp_api.versions[first.pipeline_id][-1]["pipeline_version_id"]


def test_run_sends_version_reference_and_typed_params(kfp_api: StandIn, package_path: Path) -> None:
    server = Server(kfp_api.url, TOKEN)
    client = connect(server)
    package = read_package(package_path)
    upload(client, server, package, name="trace-training")
    newest = upload(client, server, package, name="trace-training", version="v2")
    kfp_api.requests.clear()

    target = resolve(client, server, "trace-training")
    assert target.version_id == newest.version_id  # the newest version by default
    params = build_params(package, ["iterations=3"], "nightly")
    made = run(client, server, target, params, experiment="trace-rl", display_name="nightly-1")

    assert kfp_api.calls() == [
        ("GET", f"{API}/pipelines"),
        ("GET", f"{API}/pipelines/{target.pipeline_id}/versions"),
        ("GET", f"{API}/experiments"),  # create_experiment looks the name up first
        ("POST", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    versions = kfp_api.last("GET", f"{API}/pipelines/{target.pipeline_id}/versions")
    assert (versions.query["sort_by"], versions.query["page_size"]) == ("created_at desc", "1")
    assert kfp_api.last("POST", f"{API}/experiments").body["display_name"] == "trace-rl"  # type: ignore[index]
    body = kfp_api.last("POST", f"{API}/runs").body
    assert body == {
        "experiment_id": made.experiment_id,
        "display_name": "nightly-1",
        "pipeline_version_reference": {
            "pipeline_id": newest.pipeline_id,
            "pipeline_version_id": newest.version_id,
        },
        "runtime_config": {"parameters": {"run_name": "nightly", "iterations": 3}},
    }
    assert made.url == f"{kfp_api.url}/#/runs/details/{made.id}"

    # A second run in the same experiment reuses it (looked up by name, not created again).
    run(client, server, target, params, experiment="trace-rl")
    assert len(kfp_api.experiments) == 1


def test_run_pins_a_named_version(kfp_api: StandIn, package_path: Path) -> None:
    server = Server(kfp_api.url)
    client = connect(server)
    package = read_package(package_path)
    upload(client, server, package, name="trace-training")
    v2 = upload(client, server, package, name="trace-training", version="v2")
    upload(client, server, package, name="trace-training", version="v3")
    target = resolve(client, server, "trace-training", "v2")
    assert target.version_id == v2.version_id
    sent = kfp_api.last("GET", f"{API}/pipelines/{v2.pipeline_id}/versions")
    assert json.loads(sent.query["filter"])["predicates"][0]["stringValue"] == "v2"
    with pytest.raises(SubmitError, match="--version 'v9'"):
        resolve(client, server, "trace-training", "v9")
    with pytest.raises(SubmitError, match="--pipeline 'missing'"):
        resolve(client, server, "missing")


def test_schedule_is_a_cron_recurring_run_that_resumes(
    kfp_api: StandIn, package_path: Path
) -> None:
    server = Server(kfp_api.url, TOKEN)
    client = connect(server)
    package = read_package(package_path)
    version = upload(client, server, package, name="trace-training")
    params = build_params(package, ["iterations=2"], "nightly")

    made = schedule(client, server, version, "0 0 3 * * *", params, "nightly-schedule")

    body = kfp_api.last("POST", f"{API}/recurringruns").body
    assert body is not None
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * *"}}
    assert body["max_concurrency"] == 1
    assert body["no_catchup"] is True
    assert body["mode"] == "ENABLE"
    assert body["display_name"] == "nightly-schedule"
    assert body["experiment_id"] == made.experiment_id
    assert body["pipeline_version_reference"] == {
        "pipeline_id": version.pipeline_id,
        "pipeline_version_id": version.version_id,
    }
    # The same run_name in every scheduled run: each resumes the checkpoints of the one before.
    assert body["runtime_config"] == {"parameters": {"run_name": "nightly", "iterations": 2}}
    assert made.id.startswith("recurring-")


def test_runs_lists_newest_first_with_their_run_name(kfp_api: StandIn, package_path: Path) -> None:
    server = Server(kfp_api.url)
    client = connect(server)
    package = read_package(package_path)
    target = upload(client, server, package, name="trace-training")
    for name in ("a", "b"):
        run(client, server, target, build_params(package, [], name), display_name=f"run-{name}")
    kfp_api.requests.clear()

    rows = runs(client, server, limit=5)
    sent = kfp_api.last("GET", f"{API}/runs")
    assert (sent.query["sort_by"], sent.query["page_size"]) == ("created_at desc", "5")
    assert [(r.display_name, r.run_name, r.state) for r in rows] == [
        ("run-b", "b", "PENDING"),
        ("run-a", "a", "PENDING"),
    ]
    rows = runs(client, server, experiment="trace-rl")
    experiment_id = next(iter(kfp_api.experiments))
    assert kfp_api.last("GET", f"{API}/runs").query["experiment_id"] == experiment_id
    with pytest.raises(SubmitError, match="--experiment 'nope'"):
        runs(client, server, experiment="nope")


def test_server_errors_never_show_the_token(kfp_api: StandIn) -> None:
    server = Server(kfp_api.url, TOKEN)
    client = connect(server)
    kfp_api.reject = True  # from now on: 401, with the request's Authorization header echoed
    with pytest.raises(SubmitError) as caught:
        runs(client, server)
    assert "401" in str(caught.value)
    assert TOKEN not in str(caught.value)
    assert "***" in str(caught.value)  # the echoed token, scrubbed


# --- the CLI ---------------------------------------------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["pipeline", *args], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split())


def test_cli_upload_run_schedule_runs(
    kfp_api: StandIn, package_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KFP_HOST", kfp_api.url)  # host and token from the environment
    monkeypatch.setenv("KFP_TOKEN", TOKEN)
    pkg = ["--package", str(package_path)]

    code, out = _cli("upload", *pkg, "--name", "trace-training")
    assert code == 0, out
    assert "new pipeline 'trace-training'" in out
    code, out = _cli("upload", *pkg, "--name", "trace-training", "--version", "v2")
    assert code == 0, out
    assert "new version 'trace-training': version 'v2'" in out

    code, out = _cli("run", *pkg, "--pipeline", "trace-training", "--run-name", "nightly",
                     "--param", "iterations=3")  # fmt: skip
    assert code == 0, out
    assert "of version 'v2'" in out
    assert kfp_api.last("POST", f"{API}/runs").body["runtime_config"] == {  # type: ignore[index]
        "parameters": {"run_name": "nightly", "iterations": 3}
    }

    code, out = _cli("schedule", *pkg, "--pipeline", "trace-training", "--run-name", "nightly",
                     "--cron", "0 30 2 * * *")  # fmt: skip
    assert code == 0, out
    assert "max concurrency 1, catch-up off" in out
    body = kfp_api.last("POST", f"{API}/recurringruns").body
    assert body is not None
    assert (body["display_name"], body["no_catchup"], body["max_concurrency"]) == (
        "nightly-schedule",
        True,
        1,
    )

    code, out = _cli("runs")
    assert code == 0, out
    assert "nightly" in out and "PENDING" in out

    assert {r.headers["authorization"] for r in kfp_api.requests} == {f"Bearer {TOKEN}"}
    kfp_api.reject = True
    code, out = _cli("runs")
    assert code == 2
    assert f"--host {kfp_api.url}: the KFP API answered HTTP 401" in out
    assert TOKEN not in out  # never in the output, even when the server repeats it


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("schedule", "--run-name", "n", "--cron", "0 3 * * *"), "--cron"),
        (("run", "--run-name", "n", "--param", "nope=1"), "--param nope"),
        (("run", "--run-name", "bad/name"), "--run-name"),
        (("run", "--run-name", "n", "--pipeline", "missing"), "--pipeline 'missing'"),
    ],
)
def test_cli_errors_name_the_flag(
    kfp_api: StandIn,
    package_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    names: str,
) -> None:
    monkeypatch.setenv("KFP_HOST", kfp_api.url)
    code, out = _cli(*args, "--package", str(package_path))
    assert code == 2, out
    assert f"error: {names}" in out


def test_cli_schedules_the_committed_pipeline(
    kfp_api: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real compiled pipeline, uploaded and scheduled with its default package path."""
    monkeypatch.setenv("KFP_HOST", kfp_api.url)
    code, out = _cli("upload")
    assert code == 0, out
    assert "new pipeline 'trace-training'" in out
    assert kfp_api.last("POST", f"{API}/pipelines/upload").files["uploadfile"][1] == (
        DEFAULT_PACKAGE.read_bytes()
    )
    schedule = ["schedule", "--run-name", "nightly", "--cron", "0 0 3 * * *"]
    code, out = _cli(*schedule, "--param", "store_uri=s3://mlpipeline/trace", "--param", "k=2")
    assert code == 2
    assert "error: --param k: the pipeline has no such parameter" in out
    params = (
        "store_uri=s3://mlpipeline/trace",
        "iterations=20",
        "max_staleness=1",
        "retriever_url=http://trace-retriever:8000",
    )
    code, out = _cli(*schedule, *(part for p in params for part in ("--param", p)))
    assert code == 0, out
    body = kfp_api.last("POST", f"{API}/recurringruns").body
    assert body is not None
    assert body["runtime_config"] == {
        "parameters": {
            "run_name": "nightly",
            "store_uri": "s3://mlpipeline/trace",
            "iterations": 20,
            "max_staleness": 1,
            "retriever_url": "http://trace-retriever:8000",
        }
    }


def test_cli_without_host_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KFP_HOST", "KF_PIPELINES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    code, out = _cli("runs")
    assert code == 2
    assert "--host (or KFP_HOST) is required" in out


def test_cli_unreachable_host_fails_fast(kfp_api: StandIn) -> None:
    with socket.socket() as sock:  # a port nothing listens on: bound, then released
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    code, out = _cli("runs", "--host", f"http://127.0.0.1:{port}")
    assert code == 2
    assert f"--host http://127.0.0.1:{port}: cannot reach the KFP API" in out
    assert time.monotonic() - started < 5  # not kfp.Client's 5 retries × 5 s
    assert not kfp_api.requests
