"""What a run holds on the Ray cluster, found by its session's name, and set free: its steps'
Ray jobs still running, its trainer actors (and the devices their group reserved) and its kept
engine actors. The pipeline's exit handler calls it (``steps.release``) whether the run
succeeded, failed or was cancelled, from what an exit task has: the run's parameters and the
KFP run's id, which name the session (``contract.session_name``); a person can too:

    release_session("calc-0a1b2c3d", ray_address="10.0.0.5:6379")    # the steps join the head
    release_session("calc-0a1b2c3d", ray_jobs_url="http://head:8265")   # they run as Ray jobs
    python3 -m trace_core.train.release calc-0a1b2c3d --ray-address 10.0.0.5:6379

With ``ray_jobs_url`` the session's jobs (their metadata's ``trace.session``) are stopped
first, so none starts an actor again, then a small Ray job kills the actors on the cluster
(this process need not reach the head's GCS); with ``ray_address`` this process joins the head
and kills them. Nothing to release is no error: the lines say what was released.

Also here: ``refuse_second_run``, which open-session calls, so two runs under one ``run_name``
never train at once (their checkpoints would interleave in one registry run).
"""

from __future__ import annotations

import re
import shlex
import sys
import time
import uuid
from collections.abc import Callable

from trace_core.rollout.ray_auth import RayAuthError, check_client, explained
from trace_core.train.contract import PipelineConfig

UPSTREAM = (
    "ray.util.list_named_actors(all_namespaces)",
    "ray.job_submission.JobSubmissionClient(address, /)",
    "ray.job_submission.JobSubmissionClient.list_jobs()",
    "ray.job_submission.JobDetails.submission_id",
    "ray.job_submission.JobDetails.status",
    "ray.job_submission.JobDetails.metadata",
    "ray.job_submission.JobStatus.is_terminal()",
    "ray.job_submission.JobSubmissionClient.stop_job(job_id, /)",
    "ray.job_submission.JobSubmissionClient.get_job_status(job_id, /)",
    "ray.job_submission.JobSubmissionClient.submit_job(entrypoint, submission_id, metadata)",
    "ray.job_submission.JobSubmissionClient.get_job_logs(job_id, /)",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""

SESSION_KEY = "trace.session"
"""The metadata key of a step's Ray job that names its run's session (``rayjob.submit_step``)."""
RELEASED = "released "
"""How each line of what was released starts (the kill job's log is read back by it)."""
STOP_WAIT_S = 120.0
"""How long a release waits for a stopped job to end (Ray stops it, then kills it)."""
KILL_JOB_S = 600.0
"""How long a release waits for its own job (the one that kills the actors) to end."""


def release_session(
    session: str,
    ray_address: str = "",
    ray_jobs_url: str = "",
    say: Callable[[str], None] = print,
) -> list[str]:
    """Stop the Ray jobs of ``session`` and kill its actors (see the module docstring);
    returns (and ``say``s) one line per thing released. Without an address there is nothing
    to release: the run's actors went with its steps' processes."""
    if not session:
        raise ValueError("no session name to release")
    lines: list[str] = []
    where = ray_jobs_url or ray_address
    if ray_jobs_url:  # an address is checked where the session connects (ray_session)
        check_client(ray_jobs_url)
    with explained(where):
        if ray_jobs_url:
            lines += _stop_jobs(ray_jobs_url, session)
            lines += _kill_by_job(ray_jobs_url, session)
        elif ray_address:
            lines += kill_actors(session, ray_address)
    for line in lines or [f"session {session}: nothing to release"]:
        say(line)
    return lines


def kill_actors(session: str, address: str | None) -> list[str]:
    """Kill the trainer and kept engine actors of ``session`` on the head at ``address``
    ("auto": the Ray job this runs in), and remove their placement groups (the run's, which
    reserved both: ``rollout.placement``)."""
    from trace_core.rollout.ray_pool import ray_session, release_engines
    from trace_core.rollout.ray_worker import KEPT_NAMESPACE
    from trace_core.train.trainer_group import (
        TRAINER_NAMESPACE,
        release_run_group,
        release_trainers,
    )

    with ray_session(address):
        trainers = session_actors(session, TRAINER_NAMESPACE)
        engines = session_actors(session, KEPT_NAMESPACE)
        release_trainers(f"{session}-trainer", 1 + max(trainers.values(), default=-1))
        release_engines(session)
        release_run_group(session)  # the run's devices, trainers' and engines' at once
    return [f"{RELEASED}trainer actor {name}" for name in sorted(trainers)] + [
        f"{RELEASED}engine actor {name}" for name in sorted(engines)
    ]


def session_actors(session: str, namespace: str) -> dict[str, int]:
    """The live named actors of ``session`` in ``namespace`` → their index: trainers
    ``<session>-trainer-<rank>`` (``trace-trainers``), engines ``<session>-<i>``."""
    import ray

    middle = "-trainer" if namespace.endswith("trainers") else ""
    pattern = re.compile(rf"{re.escape(session)}{middle}-(\d+)")
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = pattern.fullmatch(actor["name"])
        if actor["namespace"] == namespace and match:
            found[actor["name"]] = int(match[1])
    return found


def refuse_second_run(config: PipelineConfig) -> None:
    """Raise, in one line, when a session of the same ``run_name`` other than this run's has
    trainer actors on the cluster (Ray connected): two runs of one name would train into one
    registry run at once. Sessions are ``<run_id>-<8 hex>`` (``contract.session_name``)."""
    import ray

    from trace_core.train.trainer_group import TRAINER_NAMESPACE

    if not config.run_name:
        return
    pattern = re.compile(rf"({re.escape(config.run_name)}-[0-9a-f]{{8}})-trainer-\d+")
    others = sorted(
        {
            match[1]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == TRAINER_NAMESPACE
            and (match := pattern.fullmatch(actor["name"]))
            and match[1] != config.engine_name
        }
    )
    if others:
        where = config.train.ray_address or config.ray_jobs_url or "ADDRESS"
        flag = "--ray-jobs-url" if config.ray_jobs_url else "--ray-address"
        raise RuntimeError(
            f"run_name {config.run_name!r} is in use: the trainers of its session "
            f"{', '.join(others)} run on the Ray cluster, and two runs of one name would train "
            "into one registry run at once; wait for that run to end (a cancelled or failed "
            "run's exit handler releases it; idle, its actors stop after keep_alive_s), or "
            f"release it: python3 -m trace_core.train.release {others[0]} {flag} {where}"
        )


# --- jobs -------------------------------------------------------------------------------------
def _stop_jobs(url: str, session: str) -> list[str]:
    """Stop the session's steps' Ray jobs that still run, and wait for them to end."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(url)
    running = [
        job.submission_id
        for job in client.list_jobs()
        if (job.metadata or {}).get(SESSION_KEY) == session
        and job.submission_id
        and not job.status.is_terminal()
    ]
    for job_id in running:
        client.stop_job(job_id)
    deadline = time.monotonic() + STOP_WAIT_S
    for job_id in running:
        while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
            time.sleep(1.0)
    return [f"{RELEASED}Ray job {job_id} (stopped)" for job_id in running]


def _kill_by_job(url: str, session: str) -> list[str]:
    """``kill_actors`` run as a Ray job on the cluster; its lines, read back from its log."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(url)
    job_id = f"trace-release-{session}-{uuid.uuid4().hex[:8]}"
    command = ["python3", "-m", "trace_core.train.release", session, "--ray-address", "auto"]
    client.submit_job(
        entrypoint=shlex.join(command), submission_id=job_id, metadata={"trace.release": session}
    )
    deadline = time.monotonic() + KILL_JOB_S
    while not (status := client.get_job_status(job_id)).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            break
        time.sleep(1.0)
    logs: str = client.get_job_logs(job_id)
    if str(status.value) != "SUCCEEDED":
        tail = "\n".join(logs.splitlines()[-20:])
        raise RuntimeError(f"Ray job {job_id} (kill session {session}) ended {status}:\n{tail}")
    return [line for line in logs.splitlines() if line.startswith(RELEASED)]


def main(argv: list[str]) -> int:
    """``python3 -m trace_core.train.release SESSION (--ray-address A | --ray-jobs-url U)``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m trace_core.train.release")
    parser.add_argument("session", help="the run's session: <run_id>-<8 hex>")
    parser.add_argument("--ray-address", default="", help="the head's GCS HOST:PORT, or auto")
    parser.add_argument("--ray-jobs-url", default="", help="the Ray dashboard http://HEAD:8265")
    args = parser.parse_args(argv)
    try:
        release_session(args.session, args.ray_address, args.ray_jobs_url)
    except RayAuthError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
