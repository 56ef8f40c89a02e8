"""A run stopped mid-step frees what it held: the pipeline through KFP's local runner on a
loopback Ray head, its open-session step stopped by SIGTERM (what Kubernetes sends a cancelled
run's pod) once the session's actors are up; the run fails, and its exit handler's task
(``release-session``) releases the session. Beside tests/pipelines/test_local_run.py, in a file
of its own so that the suite's workers run the two side by side."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipelines.local import LocalRun, run_local
from trace_core.train.contract import PipelineParameters

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*have no effect in the current local runner"),
    pytest.mark.filterwarnings("ignore:You may be attemping to run a task"),
]

TINY = {"warmstart_steps": 20, "prompts": 16, "eval_tasks": 8, "eval_k": 1, "max_tokens": 16}


def _step_process(function: str) -> int | None:
    """The pid of the running KFP step of this test that executes ``function`` (its
    executor's command line names it after ``--function_to_execute``), or None. Only this
    process's descendants: another test's pipeline may run the same step meanwhile."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        step = b"--function_to_execute" in argv and function.encode() in argv
        # The executor itself, not the shell that starts it.
        if step and b"python" in argv[0] and _descends_from(int(entry.name), os.getpid()):
            return int(entry.name)
    return None


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def test_a_run_stopped_mid_step_frees_what_it_held(
    tmp_path: Path,
    s3_env: dict[str, str],
    start_ray_head: Callable[..., Any],
) -> None:
    """A run whose open-session step gets SIGTERM (what Kubernetes sends a cancelled run's
    pod) once the session's trainer and engine actors are up fails there, and its exit handler
    releases the session it left on the Ray head: no actor and no placement group of the run
    is left."""
    import ray
    from ray.util import placement_group_table

    def held() -> list[str]:
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        table = placement_group_table().values()
        groups = [g["name"] for g in table if g["state"] != "REMOVED"]
        return sorted(name for name in actors + groups if name.startswith("stopped-"))

    with start_ray_head() as head, ray.init(address=head.address, logging_level="error"):
        params = PipelineParameters(
            iterations=1,
            budget=8,
            run_name="stopped",
            settings_json=json.dumps(TINY),
            store_uri="s3://trace/stopped",
            ray_address=head.address,
        )
        run_ = LocalRun(output=tmp_path, params=params)
        failed: list[BaseException] = []

        def run() -> None:
            try:
                run_local(run_, say=lambda _line: None, terminal=io.StringIO())
            except BaseException as err:
                failed.append(err)

        runner = threading.Thread(target=run)
        runner.start()
        up = []  # the session's trainer, its placement group and its engine
        while runner.is_alive() and len(up) < 3:
            up = held()
            time.sleep(0.2)
        pid = _step_process("open_session")
        assert len(up) == 3 and pid is not None, (up, failed)
        os.kill(pid, signal.SIGTERM)
        runner.join(timeout=600)
        assert not runner.is_alive() and failed, "the stopped run should have failed"
        log = next((tmp_path / "logs").glob("*.log")).read_text()
        assert "release-session" in log and "released trainer actor stopped-" in log, log[-3000:]
        for _ in range(300):  # Ray removes a placement group asynchronously
            if not held():
                break
            time.sleep(0.2)
        assert held() == []
