"""How every Ray head here starts (``pipelines.ray_head.started_head``): a ``ray start`` that
exits before its head answers, on a port another process took between the pick and the bind,
is started again on fresh ports; one that keeps exiting fails with its own output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import pipelines.ray_head as ray_head
from pipelines.ray_head import Launched, loopback_head, session_pids, started_head


@pytest.mark.slow
@pytest.mark.cluster
def test_make_runs_head_starts_again_on_fresh_ports_when_its_port_was_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first port ``loopback_head`` picks is held by another server: that ``ray start``
    exits, the next one comes up on other ports, answers a token client and is gone after."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        picks = iter([held])
        real = ray_head.free_port
        monkeypatch.setattr(ray_head, "free_port", lambda: next(picks, None) or real())
        token = os.environ["RAY_AUTH_TOKEN"]
        with loopback_head(token, num_cpus=1) as address:
            assert address != f"127.0.0.1:{held}"
            env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
            status = [ray_head._ray(), "status", f"--address={address}"]
            done = subprocess.run(status, env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-2000:]
            (pid,) = _heads(address)
        assert session_pids(pid) == []


def _heads(address: str) -> list[int]:
    """Pids of the ``ray start`` processes serving ``address``."""
    import psutil

    flag = f"--port={address.rpartition(':')[2]}"
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "start" in (p.info["cmdline"] or []) and flag in (p.info["cmdline"] or [])
    ]


def test_a_start_that_keeps_exiting_fails_with_its_output() -> None:
    """Every try exits first: after ``attempts`` of them, one error with the last one's output,
    and nothing of any try left running or on disk."""
    tries: list[Launched] = []

    def start() -> tuple[Launched, int]:
        temp_dir = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))
        with (temp_dir / "ray-start.log").open("wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"print('bind failed, try {len(tries) + 1}'); raise SystemExit(3)",
                ],
                start_new_session=True,
                stdout=log,
            )
        tries.append(Launched(process, temp_dir))
        return tries[-1], len(tries)

    with pytest.raises(RuntimeError) as failed, started_head(start, lambda _: False, attempts=3):
        raise AssertionError("a head that never answered was yielded")
    assert str(failed.value).startswith("ray start exited (3) 3 times; its last output:")
    assert "bind failed, try 3" in str(failed.value)
    assert len(tries) == 3
    assert not any(t.temp_dir.exists() or session_pids(t.process.pid) for t in tries)


def test_a_head_that_answers_is_yielded_once_and_stopped_after() -> None:
    """The first try answers: no second start, and after the block it is stopped."""
    tries: list[Launched] = []

    def start() -> tuple[Launched, str]:
        temp_dir = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))
        with (temp_dir / "ray-start.log").open("wb") as log:
            process = subprocess.Popen(
                ["sleep", "600"], start_new_session=True, stdout=log, stderr=subprocess.STDOUT
            )
        tries.append(Launched(process, temp_dir))
        return tries[-1], "up"

    with started_head(start, lambda head: head == "up") as head:
        assert head == "up" and tries[0].process.poll() is None
    assert len(tries) == 1 and tries[0].process.poll() is not None
    assert not tries[0].temp_dir.exists()
