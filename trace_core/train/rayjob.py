"""A pipeline step run as a Ray job on a (Kube)Ray cluster: submit, stream its logs, fetch its
outputs, and fail when it fails.

    submit_step(StepCall("iterate", 3, inputs, outputs), config)   # config.ray_jobs_url set

The job's entrypoint is the same command a person would type, ``trace-rl step iterate
--config-json ... --input state=s3://... --output trees=s3://...``; it runs on the head (or
wherever the cluster places the driver) with the cluster's image. Inputs and outputs cross
through S3: an input already in object storage (a KFP artifact's ``minio://`` URI on a cluster)
is passed as is, any other is uploaded under ``<store>/staging/<job id>/in/<name>``; outputs are
written by the job to ``.../out/<name>`` and downloaded into the step's own output folders, so
the KFP artifacts carry the results (an output that is itself an ``s3://`` prefix, as in the Argo
workflow's steps, is written there by the job). The staging folder stays while the run goes on
(the job's record); when the run ends, close-session and the exit handler's release delete the
run's (``steps.handoff.remove_scratch``, by the job id: ``trace-<session>-<step>-...``).

Only non-secret S3 settings (endpoint, region) go into the job's ``runtime_env``, since Ray
shows it in its dashboard: the Ray cluster's pods must get the credentials themselves (the same
Kubernetes Secret the pipeline's steps read).

A step that ends before its job (an error, Ctrl-C, or the SIGTERM Kubernetes sends when the run
is cancelled or the pod goes) stops the job first (``run_job``). The job's metadata names the
run's session (``trace.session``), by which the run's exit handler stops whatever of it still
runs (``train.release``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trace_core.rollout.ray_auth import check_client, explained
from trace_core.store.s3_settings import RUN_STORE_SETTINGS
from trace_core.store.sync import download_folder, upload_folder
from trace_core.store.uri import is_remote
from trace_core.train.contract import RAY_STEPS, PipelineConfig, StepCall

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

UPSTREAM = (
    "ray.job_submission.JobSubmissionClient(address, /)",
    "ray.job_submission.JobSubmissionClient.submit_job(entrypoint, submission_id, runtime_env, "
    "metadata)",
    "ray.job_submission.JobSubmissionClient.stop_job(job_id, /)",
    "ray.job_submission.JobSubmissionClient.get_job_info(job_id, /)",
    "ray.job_submission.JobDetails.message",
    "ray.job_submission.JobSubmissionClient.get_job_status(job_id, /)",
    "ray.job_submission.JobSubmissionClient.get_job_logs(job_id, /)",
    "ray.job_submission.JobSubmissionClient.tail_job_logs(job_id, /)",
    "ray.job_submission.JobStatus.SUCCEEDED",
    "ray.job_submission.JobStatus.FAILED",
    "ray.job_submission.JobStatus.STOPPED",
)
"""What this module calls in Ray's job client (``policy.upstream``: entry syntax there)."""

PASSED_ENV = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "S3_ENDPOINT",
    "AWS_REGION",
    *RUN_STORE_SETTINGS,
)
"""Settings the job inherits from the submitting step (never credentials: the Ray pods hold
their own, from the Secrets trace-s3 and, for a run store, trace-store)."""
_DONE = ("SUCCEEDED", "FAILED", "STOPPED")


class RayJobFailed(RuntimeError):
    """The job ended FAILED or STOPPED; the message has Ray's reason and the log's last lines."""


class Terminated(SystemExit):
    """SIGTERM arrived while a job ran (``run_job``); the process exits with 128 + 15."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


STAGING = "staging"
"""The store's folder of the steps' Ray jobs: ``<store>/staging/<job id>/in|out/<name>``."""


def new_job_id(session: str, step: str, iteration: int) -> str:
    """A fresh id of a Ray job of the run's session: ``trace-<session>-<step>-NNNN-<8 hex>``
    (the session is ``<run_id>-<8 hex>``, ``contract.session_name``)."""
    return f"trace-{session}-{step}-{iteration:04d}-{uuid.uuid4().hex[:8]}"


def is_job_of(session: str, name: str) -> bool:
    """Whether ``name`` is an id ``new_job_id`` gives a job of ``session`` (of no other)."""
    steps = "|".join(re.escape(step) for step in RAY_STEPS)
    return bool(re.fullmatch(rf"trace-{re.escape(session)}-({steps})-\d{{4}}-[0-9a-f]{{8}}", name))


def step_command(call: StepCall, config: PipelineConfig) -> str:
    """The shell command that runs ``call`` (with URIs) on the cluster."""
    args = ["trace-rl", "step", call.step, "--config-json", config.to_json()]
    args += ["--iteration", str(call.iteration)]
    for name, uri in call.inputs.items():
        args += ["--input", f"{name}={uri}"]
    for name, uri in call.outputs.items():
        args += ["--output", f"{name}={uri}"]
    return shlex.join(args)


def submit_step(
    call: StepCall,
    config: PipelineConfig,
    log: Callable[[str], None] | None = None,
    poll_seconds: float = 1.0,
) -> str:
    """Run ``call`` as a Ray job at ``config.ray_jobs_url``; returns the job's id."""
    check_client(config.ray_jobs_url)
    with explained(config.ray_jobs_url):
        return _submit_step(call, config, log, poll_seconds)


def _submit_step(
    call: StepCall,
    config: PipelineConfig,
    log: Callable[[str], None] | None,
    poll_seconds: float,
) -> str:
    from ray.job_submission import JobSubmissionClient

    write = log or (lambda text: print(text, end="", flush=True, file=sys.stdout))
    job_id = new_job_id(config.engine_name or config.run_id, call.step, call.iteration)
    staging = f"{config.store.rstrip('/')}/{STAGING}/{job_id}"
    inputs = {}
    for name, location in call.inputs.items():
        uri = call.input_uris.get(name, "")
        if is_remote(uri):
            inputs[name] = uri
        else:
            inputs[name] = f"{staging}/in/{name}"
            upload_folder(location, inputs[name])
    # An output already in object storage (a step run by `trace-rl step` on URIs) is written
    # there by the job itself; a local one goes through staging and is downloaded after.
    outputs = {
        name: target if is_remote(target) else f"{staging}/out/{name}"
        for name, target in call.outputs.items()
    }
    remote = StepCall(call.step, call.iteration, inputs, outputs)
    client = JobSubmissionClient(config.ray_jobs_url)
    env = {name: os.environ[name] for name in PASSED_ENV if os.environ.get(name)}
    metadata = {"trace.step": call.step, "trace.iteration": str(call.iteration)}
    metadata |= {"trace.run": config.run_id, "trace.session": config.engine_name}
    status, tail = run_job(
        client,
        job_id,
        step_command(remote, config),
        {"env_vars": env} if env else None,
        metadata,
        write,
        poll_seconds,
        where=config.ray_jobs_url,
    )
    if status != "SUCCEEDED":
        message = client.get_job_info(job_id).message or ""
        raise RayJobFailed(
            f"Ray job {job_id} ended {status}: {message.strip()}\n--- last log lines ---\n{tail}"
        )
    for name, uri in outputs.items():
        if uri != call.outputs[name]:
            download_folder(uri, call.outputs[name])
    return job_id


def run_job(
    client: Any,
    job_id: str,
    entrypoint: str,
    runtime_env: Mapping[str, Any] | None,
    metadata: Mapping[str, str],
    write: Callable[[str], None],
    poll_seconds: float = 1.0,
    where: str = "",
) -> tuple[str, str]:
    """Submit ``entrypoint`` as the Ray job ``job_id`` and stream its log until it ends; its
    final status and the log's last lines. If this process stops first (an exception,
    KeyboardInterrupt, or SIGTERM, which raises ``Terminated`` meanwhile when this is the main
    thread), the job is stopped before it goes on."""
    with _sigterm_raises():
        try:
            client.submit_job(
                entrypoint=entrypoint,
                submission_id=job_id,
                runtime_env=dict(runtime_env) if runtime_env else None,
                metadata=dict(metadata),
            )
            write(f"submitted Ray job {job_id}{f' to {where}' if where else ''}\n")
            return _follow(client, job_id, write, poll_seconds)
        except BaseException as stopped:
            why = "SIGTERM" if isinstance(stopped, Terminated) else type(stopped).__name__
            with contextlib.suppress(Exception):  # perhaps never submitted, or done already
                client.stop_job(job_id)
                write(f"\n{why}: stopped Ray job {job_id}\n")
            raise


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``Terminated`` (so ``finally`` and ``except``
    blocks run); the handler before is put back after. Only the main thread gets signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


LOG_TAIL_LINES = 20
"""How many of the log's last lines ``run_job`` returns (a failed step's error carries them)."""


def _follow(
    client: JobSubmissionClient, job_id: str, write: Callable[[str], None], poll_seconds: float
) -> tuple[str, str]:
    """Write the job's log as its driver writes it, until the job ends; returns its final status
    and the log's last ``LOG_TAIL_LINES`` lines.

    The log comes over the head's log stream (``_log_parts``), which sends each new part once
    and closes when the job has ended; the job's status is read then. A stream that closed while
    the job runs on (a dropped connection, a proxy that refuses websockets) is opened again after
    ``poll_seconds``, past what was written; one that broke as the job ended is completed from
    the whole log, fetched once."""
    shown = 0  # characters of the log written so far
    recent = ""  # the end of the log: at least its last LOG_TAIL_LINES lines
    said_broken = False
    while True:
        broken: Exception | None = None
        for part in _log_parts(client, job_id, skip=shown):
            if isinstance(part, Exception):
                broken = part
                continue
            write(part)
            shown += len(part)
            recent = "\n".join((recent + part).split("\n")[-(LOG_TAIL_LINES + 1) :])
        status = str(client.get_job_status(job_id).value)
        if status in _DONE:
            if broken is not None:
                rest = client.get_job_logs(job_id)[shown:]
                write(rest)
                recent += rest
            return status, "\n".join(recent.splitlines()[-LOG_TAIL_LINES:])
        if broken is not None and not said_broken:
            write(f"\n(the log stream of Ray job {job_id} broke: {broken}; reopening it)\n")
            said_broken = True
        time.sleep(poll_seconds)


def _log_parts(client: JobSubmissionClient, job_id: str, skip: int) -> Iterator[str | Exception]:
    """The job's log past its first ``skip`` characters, part by part as the head's websocket
    (``tail_job_logs``, which starts at the log's beginning) sends them, until it closes; last,
    if it broke rather than closed, the error. An asyncio loop in a thread of its own reads the
    websocket, so the caller's thread writes the parts and takes signals (``_sigterm_raises``) as
    any blocking call; that thread ends when the stream does (the job stopped, or ended)."""
    parts: queue.Queue[str | Exception | None] = queue.Queue()

    async def read() -> None:
        seen = 0
        async for part in client.tail_job_logs(job_id):
            if seen + len(part) > skip:
                parts.put(part[max(skip - seen, 0) :])
            seen += len(part)

    def run() -> None:
        try:
            asyncio.run(read())
            parts.put(None)
        except Exception as err:  # a dropped or refused connection: the caller reads the status
            parts.put(err)

    threading.Thread(target=run, name=f"log of {job_id}", daemon=True).start()
    while (part := parts.get()) is not None:
        yield part
        if isinstance(part, Exception):
            return
