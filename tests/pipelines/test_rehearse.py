"""``make rehearse``: the committed compiled pipeline, run against the Ray cluster of the rendered
kfp overlay with token auth on and SeaweedFS on KFP's store port (``pipelines/rehearse.py``).
A change that breaks the agreement between the manifests, the compiled pipeline and the code
fails here; what one machine cannot honour is listed, not dropped."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines.rehearse import Rehearsal, executor_env
from pipelines.trace_training import COMPILED

REPO = Path(__file__).resolve().parents[2]


def test_each_executor_gets_its_own_secrets_and_the_requests_are_listed() -> None:
    rehearsal = Rehearsal(token="t" * 64)
    documents = list(yaml.safe_load_all(COMPILED.read_text()))
    (pipeline,) = executor_env(rehearsal, documents, {"s3_secret": "mlpipeline-minio-artifact"})
    executors = pipeline["deploymentSpec"]["executors"]
    env = {
        name: {item["name"]: item["value"] for item in executor["container"]["env"]}
        for name, executor in executors.items()
    }
    assert env["exec-release-session"]["RAY_AUTH_TOKEN"] == "t" * 64
    assert env["exec-release-session"]["RAY_AUTH_MODE"] == "token"
    assert "RAY_AUTH_TOKEN" not in env["exec-prep"]  # the Secret is not this step's
    assert env["exec-prep"]["AWS_ACCESS_KEY_ID"] == "rehearsal-key"
    assert env["exec-prep"]["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:8333"
    assert not any("resources" in executor["container"] for executor in executors.values())
    listed = "\n".join(rehearsal.unhonoured)
    assert "seaweedfs.kubeflow.svc.cluster.local is 127.0.0.1" in listed
    assert "its GPU request is not made" in listed


def test_a_variable_taken_out_is_in_no_executor() -> None:
    """``--drop-env RAY_AUTH_MODE``: the rehearsal of a compiled pipeline without the mode (it
    must fail at open-session, in one line: the note of issue 59 shows that run)."""
    rehearsal = Rehearsal(token="t" * 64, dropped=("RAY_AUTH_MODE",))
    documents = list(yaml.safe_load_all(COMPILED.read_text()))
    (pipeline,) = executor_env(rehearsal, documents, {"s3_secret": "mlpipeline-minio-artifact"})
    for executor in pipeline["deploymentSpec"]["executors"].values():
        names = [item["name"] for item in executor["container"]["env"]]
        assert "RAY_AUTH_MODE" not in names
    release = pipeline["deploymentSpec"]["executors"]["exec-release-session"]
    assert "RAY_AUTH_TOKEN" in [item["name"] for item in release["container"]["env"]]


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.long  # ≈ 5 min: every step a KFP subprocess, the steps Ray jobs
def test_make_rehearse_passes(tmp_path: Path) -> None:
    """The command as the Makefile and docs/deploy.md give it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "AWS_"))}
    done = subprocess.run(
        ["make", "--no-print-directory", "rehearse", f"OUT={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "rehearsal passed" in out
    assert "not honoured here: worker group gpu: {'nvidia.com/gpu': '8'} is no GPU here" in out
    assert "Task 'release-session' finished with status SUCCESS" in _plain(out)
    for task in ("open-session", "close-session", "report"):
        assert f"Task '{task}' finished with status SUCCESS" in _plain(out), task
    assert _plain(out).count("Task 'iterate' finished with status SUCCESS") == 2


def _plain(text: str) -> str:
    """``text`` without terminal colours (KFP's local runner colours task names)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
