"""Shared by every test folder: a real Ray head on 127.0.0.1, started and stopped by its pid.

What several test folders share lives in the package ``tests/support``, imported here once as
``support`` (``from support import parity``). Not by putting ``tests/`` on the path: its folders
would shadow the packages they test (``tests/components``, ``tests/pipelines``, ``tests/vllm``).

The head is ``ray start --head --block`` in a session of its own, on free ports, with its
own temp dir and token auth on (the session's token, below). It is stopped with SIGTERM to the
``ray start`` process, which drains and stops GCS, raylet and workers; anything of that
session still alive afterwards is killed by pid, and the fixture checks none is left.
``ray stop`` is never used: it would stop every Ray on the machine.

    def test_x(start_ray_head):
        with start_ray_head(dashboard=True, env={"AWS_ENDPOINT_URL": ...}) as head:
            ... head.address (GCS, for ray.init / --ray-address), head.dashboard_url (jobs)

``make test`` runs the suite on every core (``pytest -n auto --dist loadfile
--no-loadscope-reorder``): a file's tests stay in one worker, sharing its module fixtures, and
files go out in the order collected, where the few tests marked ``long`` come first.

Also a real SeaweedFS S3 server on 127.0.0.1 (``seaweed``, bucket ``trace``, one per session)
and ``s3_env``, its endpoint and credentials in the environment, for the storage tests and the
steps run on s3:// folders (tests/train/test_step_cli.py); and a real MLflow tracking server
(``mlflow_uri``, one per session, from .venv-mlflow, which ``make test`` builds).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipelines.ray_head import (
    Launched,
    answers,
    free_port,
    launch,
    session_pids,
    started_head,
)

if TYPE_CHECKING:
    from support.image_context import ImageVenv

    from trace_core.store.server import SeaweedServer

BIN = Path(sys.executable).parent


def share_cores() -> None:
    """Under ``pytest -n``, each worker (and what it starts) gets its share of the cores.

    Torch's default, a thread per core in every process, oversubscribes the machine as soon
    as two workers run torch at once, and its OpenMP threads then spin on each other: two
    2-thread matmul loops took 2.4× as long as two 1-thread loops on the 2-core CI machine.
    Set before torch is imported, and inherited by the subprocesses tests start.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, threads)


share_cores()
# Every Ray cluster of the suite listens on 127.0.0.1 only, and runs with token auth as the
# cluster's does (KubeRay's authOptions: mode token): the heads the suite starts (``ray_head``,
# ``pipelines.ray_head``), the in-process clusters and every client share this session's token
# through the environment, and every client sets RAY_AUTH_MODE=token beside it, as the
# pipeline's steps do. Ray reads its auth mode once per process, at its first use; the tests of
# a missing or wrong token run their clients in processes of their own.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def _import_support() -> None:
    """``tests/support`` as the package ``support``, before any test folder is collected."""
    if "support" in sys.modules:
        return
    folder = Path(__file__).parent / "support"
    spec = importlib.util.spec_from_file_location(
        "support", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["support"] = package
    spec.loader.exec_module(package)


_import_support()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` first (otherwise in the order collected): under ``pytest -n``,
    the worker that draws one runs it while the others share the rest."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test that used the session's S3 server gets the server's last error lines in
    its report: its ``InternalError`` answers say nothing of why."""
    report = yield
    server = getattr(item, "funcargs", {}).get("seaweed")
    if report.failed and server is not None:
        errors = server.errors()
        if errors:
            report.sections.append(("SeaweedFS errors", "\n".join(errors)))
    return report


@dataclass(frozen=True)
class RayHead:
    address: str
    """host:port of the GCS (``ray.init(address=...)``, ``trace-rl ... --ray-address``)."""
    dashboard_url: str | None
    """http://127.0.0.1:PORT of the job API, when started with the dashboard."""
    temp_dir: Path
    """Its sessions, sockets and logs (``session_*/logs``)."""
    pid: int


@contextlib.contextmanager
def ray_head(
    dashboard: bool = False, env: Mapping[str, str] | None = None, num_gpus: int = 0
) -> Iterator[RayHead]:
    """A Ray head for the ``with`` block; ``env`` is added to its (and its jobs') environment.
    ``num_gpus``: GPUs it advertises (``ray start --num-gpus``: Ray schedules by the count,
    without devices; ``CUDA_VISIBLE_DEVICES`` is what a task then sees, not a GPU).

    Ready means ``ray status`` answers, or, with the dashboard, its job API does. Started as
    ``make run``'s head is (``pipelines.ray_head.started_head``: a ``ray start`` that exits
    first, on a port another test's server took, is tried again on fresh ports).
    """
    full_env = {
        **os.environ,
        **(env or {}),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }

    def start() -> tuple[Launched, RayHead]:
        port, dashboard_port = free_port(), free_port()
        flags = [
            f"--port={port}",
            "--num-cpus=2",
            f"--num-gpus={num_gpus}",
            "--node-ip-address=127.0.0.1",
            f"--include-dashboard={str(dashboard).lower()}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=200000000",
            "--disable-usage-stats",
        ]
        launched = launch(flags, full_env)
        return launched, RayHead(
            address=f"127.0.0.1:{port}",
            dashboard_url=f"http://127.0.0.1:{dashboard_port}" if dashboard else None,
            temp_dir=launched.temp_dir,
            pid=launched.process.pid,
        )

    with started_head(start, lambda head: _ready(head, full_env)) as head:
        yield head
    assert session_pids(head.pid) == [], "processes of the Ray head were left running"


def _ready(head: RayHead, env: Mapping[str, str]) -> bool:
    if head.dashboard_url is None:
        return answers(head.address, env)
    request = urllib.request.Request(f"{head.dashboard_url}/api/version")
    if env.get("RAY_AUTH_TOKEN"):  # the job API answers a token-auth head's clients only
        request.add_header("Authorization", f"Bearer {env['RAY_AUTH_TOKEN']}")
    with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=2) as response:
        return bool(response.status == 200)
    return False


@pytest.fixture(scope="session")
def start_ray_head() -> Callable[..., AbstractContextManager[RayHead]]:
    """``ray_head`` (above) for fixtures of any scope."""
    return ray_head


@pytest.fixture(scope="session")
def installed_image() -> Callable[[str], ImageVenv]:
    """``installed_image("trace")``: that image's package as its Dockerfile installs it, in a
    venv that cannot see the checkout (``support.image_context``; built once per install tree
    and cached under build/image-context, ≈1 min the first time)."""
    from support.image_context import REPO, image_venv

    built: dict[str, ImageVenv] = {}

    def get(image: str) -> ImageVenv:
        if image not in built:
            built[image] = image_venv(REPO / "images" / image / "Dockerfile")
        return built[image]

    return get


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the whole session, with the bucket ``trace`` (≈2 s to start,
    ≈3 s to stop); stopped by pid (SIGTERM, then SIGKILL) when the session ends."""
    from trace_core.store.server import SeaweedServer

    server = SeaweedServer.start(tmp_path_factory.mktemp("seaweedfs"), buckets=("trace",))
    yield server
    server.stop()
    assert not server.running(), f"SeaweedFS still running after the tests: pid {server.pid}"


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The session server's endpoint and credentials in the environment, as a Secret sets them."""
    for name in ("AWS_ENDPOINT_URL_S3", "S3_ENDPOINT", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    env = seaweed.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


MLFLOW = Path(__file__).resolve().parents[1] / ".venv-mlflow" / "bin" / "mlflow"


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server on 127.0.0.1 for the session (sqlite runs, artifacts served
    by the server itself), stopped by its process group when the session ends."""
    if not MLFLOW.exists():
        pytest.fail(f"{MLFLOW} is missing: make .venv-mlflow/.installed (make test builds it)")
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job queue workers
    server = subprocess.Popen(
        [
            *(str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}"),
            *("--artifacts-destination", str(home / "artifacts")),
        ],
        env=env,
        start_new_session=True,  # its group id is its pid: how its workers are stopped
        stdout=(home / "server.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _answers(f"{uri}/health"):
            assert server.poll() is None, f"mlflow server exited: {home / 'server.log'}"
            assert time.monotonic() < deadline, "the MLflow server did not come up in 120 s"
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # a worker that outlived the server


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)
    return False
