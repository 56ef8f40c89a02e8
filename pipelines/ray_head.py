"""A Ray head on 127.0.0.1 for one local pipeline run: its steps connect to it, so the run's
trainer and engine actors outlive each step as they do on a cluster.

    with loopback_head(token) as address:     # "127.0.0.1:PORT", the GCS address; token auth
        run the pipeline with ray_address=address

The head runs in a session of its own (``ray start --block``); when the block ends it gets
SIGTERM, and whatever of its session is still running a while later is killed, so no actor
outlives the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from trace_core.rollout.ray_auth import CLIENT_ENV, TOKEN_ENV

READY_TIMEOUT_S = 90.0
OBJECT_STORE_BYTES = 500_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray() -> str:
    """This environment's ``ray`` command."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def session_pids(sid: int) -> list[int]:
    """Live processes of the session ``sid`` (the head and everything it started)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(process.pid) == sid:
                found.append(process.pid)
    return found


@contextlib.contextmanager
def loopback_head(token: str, num_cpus: int | None = None) -> Iterator[str]:
    """Start the head, wait until it answers, yield its address; stop it all after the block.
    It requires ``token`` as the cluster's heads do (``RAY_AUTH_MODE=token``): its clients
    need ``RAY_AUTH_TOKEN=token`` and ``RAY_AUTH_MODE=token`` (``rollout.ray_auth``).
    ``num_cpus``: what it schedules (default: this machine's cores, at least 4, so that one
    trainer and the engine actors of a small run fit on two cores)."""
    if not token:
        raise ValueError("loopback_head needs a token: its head runs with token auth")
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayl", dir="/tmp")  # short: socket paths <= 107 bytes
    env = {**os.environ, **CLIENT_ENV, TOKEN_ENV: token}
    cpus = num_cpus or max(4, os.cpu_count() or 1)
    command = [
        _ray(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        f"--num-cpus={cpus}", "--num-gpus=0", "--include-dashboard=false",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", "--block",
    ]  # fmt: skip
    head = subprocess.Popen(
        command,
        env=env,
        start_new_session=True,  # its session id is its pid: how its processes are found
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        status = [_ray(), "status", f"--address={address}"]
        while subprocess.run(status, env=env, capture_output=True).returncode != 0:
            if head.poll() is not None:
                raise RuntimeError(f"ray start exited ({head.returncode}): {' '.join(command)}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray head at {address} did not answer in {READY_TIMEOUT_S:g} s"
                )
            time.sleep(0.5)
        yield address
    finally:
        stop_head(head, temp_dir)


def stop_head(head: subprocess.Popen[bytes], temp_dir: str | Path) -> None:
    """Stop a ``ray start --head --block`` started in a session of its own: SIGTERM (it drains
    for up to 30 s), then SIGKILL whatever of its session still runs, then its temp folder."""
    head.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(timeout=40)
    for pid in session_pids(head.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while session_pids(head.pid) and time.monotonic() < deadline:
        time.sleep(0.5)  # a killed process takes a moment to go
    shutil.rmtree(temp_dir, ignore_errors=True)
