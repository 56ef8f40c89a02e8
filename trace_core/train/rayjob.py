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
workflow's steps, is written there by the job). The staging prefix is kept (the job's record).

Only non-secret S3 settings (endpoint, region) go into the job's ``runtime_env``, since Ray
shows it in its dashboard: the Ray cluster's pods must get the credentials themselves (the same
Kubernetes Secret the pipeline's steps read).

A step that ends before its job (an error, Ctrl-C, or the SIGTERM Kubernetes sends when the run
is cancelled or the pod goes) stops the job first (``run_job``). The job's metadata names the
run's session (``trace.session``), by which the run's exit handler stops whatever of it still
runs (``train.release``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from trace_core.store.sync import download_folder, upload_folder
from trace_core.store.uri import is_remote
from trace_core.train.contract import PipelineConfig, StepCall

UPSTREAM = (
    "ray.job_submission.JobSubmissionClient(address, /)",
    "ray.job_submission.JobSubmissionClient.submit_job(entrypoint, submission_id, runtime_env, "
    "metadata)",
    "ray.job_submission.JobSubmissionClient.stop_job(job_id, /)",
    "ray.job_submission.JobSubmissionClient.get_job_info(job_id, /)",
    "ray.job_submission.JobDetails.message",
    "ray.job_submission.JobSubmissionClient.get_job_status(job_id, /)",
    "ray.job_submission.JobSubmissionClient.get_job_logs(job_id, /)",
    "ray.job_submission.JobStatus.SUCCEEDED",
    "ray.job_submission.JobStatus.FAILED",
    "ray.job_submission.JobStatus.STOPPED",
)
"""What this module calls in Ray's job client (``policy.upstream``: entry syntax there)."""

PASSED_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT", "AWS_REGION")
"""Settings the job inherits from the submitting step (never credentials)."""
_DONE = ("SUCCEEDED", "FAILED", "STOPPED")


class RayJobFailed(RuntimeError):
    """The job ended FAILED or STOPPED; the message has Ray's reason and the log's last lines."""


class Terminated(SystemExit):
    """SIGTERM arrived while a job ran (``run_job``); the process exits with 128 + 15."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


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
    from ray.job_submission import JobSubmissionClient

    write = log or (lambda text: print(text, end="", flush=True, file=sys.stdout))
    job_id = f"trace-{config.run_id}-{call.step}-{call.iteration:04d}-{uuid.uuid4().hex[:8]}"
    staging = f"{config.store.rstrip('/')}/staging/{job_id}"
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


def _follow(
    client: object, job_id: str, write: Callable[[str], None], poll_seconds: float
) -> tuple[str, str]:
    """Stream the job's log until it ends; returns its final status and the log's last lines."""
    shown = 0
    while True:
        status = str(client.get_job_status(job_id).value)  # type: ignore[attr-defined]
        logs: str = client.get_job_logs(job_id)  # type: ignore[attr-defined]
        if len(logs) > shown:
            write(logs[shown:])
            shown = len(logs)
        if status in _DONE:
            return status, "\n".join(logs.splitlines()[-20:])
        time.sleep(poll_seconds)
