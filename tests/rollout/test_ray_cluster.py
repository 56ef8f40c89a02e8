"""``trace-rl rollout --workers 2 --ray-address`` against a real Ray head on 127.0.0.1.

The head is ``ray start --head --block`` in a session of its own, on free ports, with its
own temp dir, token auth off (loopback only) and the dashboard off. It is stopped with
SIGTERM to the ``ray start`` process, which drains and stops GCS, raylet and workers; any
process of that session still alive after that is killed by pid, and the test checks none
is left. ``ray stop`` is never used: it would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
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

import numpy as np
import pytest

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.store.schema import read_trees

pytestmark = pytest.mark.cluster

BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # both sides of a loopback-only head


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the head and everything it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return pids


@pytest.fixture
def ray_head() -> Iterator[tuple[str, Path]]:
    """(address, temp dir) of a Ray head that lives for the test."""
    port = free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))  # short: socket paths ≤ 107
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=200000000",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            "--block",
        ],
        env=ENV,
        start_new_session=True,  # its session id is its pid: how its processes are found
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            status = [str(BIN / "ray"), "status", f"--address={address}"]
            if subprocess.run(status, env=ENV, capture_output=True).returncode == 0:
                break
            assert head.poll() is None, "ray start exited"
            assert time.monotonic() < deadline, "the Ray head did not come up in 60 s"
            time.sleep(0.5)
        yield address, temp_dir
    finally:
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=40)  # it drains for up to 30 s
        for pid in session_pids(head.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        assert session_pids(head.pid) == [], "processes of the Ray head were left running"
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_rollout_with_two_workers_on_a_ray_head(ray_head: tuple[str, Path], tmp_path: Path) -> None:
    address, temp_dir = ray_head
    suite = CalcSuite()
    tokenizer = build_word_tokenizer(suite.vocabulary())
    checkpoint = tmp_path / "policy"
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, checkpoint)
    trees_path, metrics_path = tmp_path / "trees.parquet", tmp_path / "metrics.json"
    # 16 roots × (1 + 2/2) = 32 units.
    command = [
        str(BIN / "trace-rl"),
        "rollout",
        f"--checkpoint={checkpoint}",
        "--workers=2",
        f"--ray-address={address}",
        "--budget=16",
        "--continuations=2",
        "--prompts=16",
        "--max-tokens=12",
        f"--output={trees_path}",
        f"--metrics={metrics_path}",
    ]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

    trees = read_trees(trees_path)
    assert trees and sum(t.units for t in trees) == 32.0
    assert len({t.info.tree_id for t in trees}) == len(trees)
    for tree in trees:
        assert tree.info.strategy == "trace"
        assert not np.isnan(tree.reward[tree.leaf_mask]).any()
    metrics = json.loads(metrics_path.read_text())
    assert metrics["strategy"] == "trace" and metrics["units"] == 32.0
    assert metrics["tokens"] == sum(t.generated_tokens for t in trees) > 0
    # The engine actors ran on this head, not on a Ray started inside the command.
    logs = list(temp_dir.glob("session_*/logs/worker-*"))
    assert any("EngineWorker" in p.read_text(errors="replace") for p in logs)
