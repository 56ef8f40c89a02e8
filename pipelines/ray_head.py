"""A Ray head on 127.0.0.1 for one local pipeline run: its steps connect to it, so the run's
trainer and engine actors outlive each step as they do on a cluster.

    with loopback_head(token) as address:     # "127.0.0.1:PORT", the GCS address; token auth
        run the pipeline with ray_address=address

The head runs in a session of its own (``ray start --block``); when the block ends it gets
SIGTERM, and whatever of its session is still running a while later is killed, so no actor
outlives the run. ``started_head`` is how every head here starts (the suite's too,
``tests/conftest.py``): on ports found free, which another process can take before Ray binds
them, so a ``ray start`` that exits before its head answers is started again on fresh ones.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from trace_core.rollout.ray_auth import CLIENT_ENV, TOKEN_ENV

READY_TIMEOUT_S = 90.0
OBJECT_STORE_BYTES = 500_000_000
START_ATTEMPTS = 3
"""``ray start`` tries, each on fresh ports (``started_head``)."""

Head = TypeVar("Head")


def free_port() -> int:
    """A port of 127.0.0.1 free now (another process may take it before it is bound)."""
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


@dataclass(frozen=True)
class Launched:
    """A ``ray start --head --block`` process, in a session of its own."""

    process: subprocess.Popen[bytes]
    temp_dir: Path
    """Its sessions, sockets and logs; ``ray-start.log``: ``ray start``'s own output."""


def launch(flags: Sequence[str], env: Mapping[str, str]) -> Launched:
    """``ray start --head --block`` with ``flags`` (its ports and resources) and a temp dir of
    its own."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))  # short: socket paths ≤ 107
    with (temp_dir / "ray-start.log").open("wb") as log:
        process = subprocess.Popen(
            [_ray(), "start", "--head", *flags, f"--temp-dir={temp_dir}", "--block"],
            env=dict(env),
            start_new_session=True,  # its session id is its pid: how its processes are found
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Launched(process, temp_dir)


@contextlib.contextmanager
def started_head(
    start: Callable[[], tuple[Launched, Head]],
    ready: Callable[[Head], bool],
    attempts: int = START_ATTEMPTS,
    timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[Head]:
    """The head ``start`` launches (on fresh ports at each call), once ``ready`` says it
    answers; stopped, with all it started, after the block (``stop_head``). A ``ray start``
    that exits before its head answers is started again, ``attempts`` times in all; then, or
    when it does not answer within ``timeout_s``, RuntimeError with its output's tail."""
    for attempt in range(1, attempts + 1):
        launched, head = start()
        try:
            up = _wait_up(launched, partial(ready, head), timeout_s)
            tail = "" if up else _tail(launched)
        except BaseException:
            stop_head(launched.process, launched.temp_dir)
            raise
        if up:
            break
        stop_head(launched.process, launched.temp_dir)
        if attempt == attempts:
            raise RuntimeError(
                f"ray start exited ({launched.process.returncode}) {attempts} times; "
                f"its last output:\n{tail}"
            )
    try:
        yield head
    finally:
        stop_head(launched.process, launched.temp_dir)


def _wait_up(launched: Launched, ready: Callable[[], bool], timeout_s: float) -> bool:
    """Whether the head answered; False when ``ray start`` exited first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if launched.process.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the Ray head did not answer in {timeout_s:g} s; ray start's output:\n"
                f"{_tail(launched)}"
            )
        time.sleep(0.5)
    return True


def answers(address: str, env: Mapping[str, str]) -> bool:
    """Whether the head at ``address`` answers ``ray status`` (its node registered), asked
    with ``env`` (a token-auth head's clients need its token)."""
    status = [_ray(), "status", f"--address={address}"]
    return subprocess.run(status, env=dict(env), capture_output=True).returncode == 0


def _tail(launched: Launched) -> str:
    """The end of ``ray start``'s output."""
    return (launched.temp_dir / "ray-start.log").read_text("utf-8", "replace")[-3000:]


@contextlib.contextmanager
def loopback_head(token: str, num_cpus: int | None = None) -> Iterator[str]:
    """Start the head, wait until it answers, yield its address; stop it all after the block.
    It requires ``token`` as the cluster's heads do (``RAY_AUTH_MODE=token``): its clients
    need ``RAY_AUTH_TOKEN=token`` and ``RAY_AUTH_MODE=token`` (``rollout.ray_auth``).
    ``num_cpus``: what it schedules (default: this machine's cores, at least 4, so that one
    trainer and the engine actors of a small run fit on two cores)."""
    if not token:
        raise ValueError("loopback_head needs a token: its head runs with token auth")
    env = {**os.environ, **CLIENT_ENV, TOKEN_ENV: token}
    cpus = num_cpus or max(4, os.cpu_count() or 1)

    def start() -> tuple[Launched, str]:
        port = free_port()
        flags = [
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
        ]
        return launch(flags, env), f"127.0.0.1:{port}"

    with started_head(start, partial(answers, env=env)) as address:
        yield address


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
