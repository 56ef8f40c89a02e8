"""Token auth as shipped: every step that the compiled pipeline or the Argo manifests give the
Ray token also sets RAY_AUTH_MODE=token, and with the environment its executor declares the
release step gets through to a token-auth head; without the mode, without a token or with a
wrong one it fails in one line naming the Secret and the variable (``rollout.ray_auth``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.trace_training import COMPILED
from trace_core.rollout.ray_auth import MODE_ENV, SECRET, SECRET_KEY, TOKEN_ENV

REPO = Path(__file__).resolve().parents[2]
ARGO = REPO / "manifests" / "argo"


def compiled_executors() -> dict[str, tuple[dict[str, str], set[str]]]:
    """Each executor of the committed pipeline: its container's env, and the variables its
    Kubernetes platform spec fills from Secrets."""
    pipeline, platform = list(yaml.safe_load_all(COMPILED.read_text()))
    executors = pipeline["deploymentSpec"]["executors"]
    kubernetes = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    found = {}
    for name, executor in executors.items():
        env = {e["name"]: e["value"] for e in executor["container"].get("env", [])}
        secret_env = {
            item["envVar"]
            for secret in kubernetes.get(name, {}).get("secretAsEnv", [])
            for item in secret["keyToEnv"]
        }
        found[name] = (env, secret_env)
    return found


def test_every_compiled_step_with_the_token_sets_the_mode() -> None:
    executors = compiled_executors()
    with_token = [name for name, (_, secret) in executors.items() if TOKEN_ENV in secret]
    assert len(with_token) >= 4  # open-session, iterate, close-session, release-session
    for name in with_token:
        assert executors[name][0].get(MODE_ENV) == "token", name
    for name, (env, secret) in executors.items():  # and no step sets the mode without a token
        assert (MODE_ENV in env) == (TOKEN_ENV in secret), name


def test_every_argo_container_with_the_token_sets_the_mode() -> None:
    checked = 0
    for path in sorted(ARGO.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for template in (doc or {}).get("spec", {}).get("templates", []):
                env = {e["name"]: e for e in template.get("container", {}).get("env", [])}
                if TOKEN_ENV in env:
                    assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"]["name"] == SECRET
                    assert env.get(MODE_ENV, {}).get("value") == "token", template["name"]
                    checked += 1
                else:
                    assert MODE_ENV not in env, template["name"]
    assert checked >= 3


@pytest.fixture(scope="module")
def head(start_ray_head: Callable[..., AbstractContextManager[Any]]) -> Iterator[Any]:
    """A dashboard head with token auth (the session's token, tests/conftest.py)."""
    with start_ray_head(dashboard=True) as started:
        yield started


def release(head: Any, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The exit handler's release, as a person runs it, in a process of its own with ``env``
    in place of this one's Ray variables (and a HOME without a token file)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    command = [sys.executable, "-m", "trace_core.train.release", "calc-0a1b2c3d"]
    return subprocess.run(
        [*command, "--ray-jobs-url", head.dashboard_url],
        env={**base, "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.cluster
def test_the_release_step_with_its_executors_environment_gets_through(
    head: Any, tmp_path: Path
) -> None:
    env, secret_env = compiled_executors()["exec-release-session"]
    assert secret_env >= {TOKEN_ENV}
    # The Secret's key, as KFP's driver puts it into the pod: the head's token.
    done = release(head, {**env, TOKEN_ENV: os.environ[TOKEN_ENV]}, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "session calc-0a1b2c3d: nothing to release" in done.stdout


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({TOKEN_ENV: "<the head's>"}, (MODE_ENV, TOKEN_ENV)),  # the token alone: Ray sends none
        ({MODE_ENV: "token"}, (SECRET, SECRET_KEY, TOKEN_ENV)),  # the Secret was missing
        ({MODE_ENV: "token", TOKEN_ENV: "0" * 64}, (SECRET, TOKEN_ENV, MODE_ENV)),  # wrong one
    ],
    ids=["no-mode", "no-token", "wrong-token"],
)
def test_a_client_the_head_would_refuse_fails_in_one_line(
    head: Any, tmp_path: Path, env: dict[str, str], named: tuple[str, ...]
) -> None:
    if env.get(TOKEN_ENV) == "<the head's>":
        env = {TOKEN_ENV: os.environ[TOKEN_ENV]}
    done = release(head, env, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ")
    for name in named:
        assert name in line
    assert "Traceback" not in done.stderr


def test_a_pipeline_step_ends_with_the_one_line_not_a_traceback() -> None:
    """The Ray steps' components run ``with step_errors()``: the executor exits with the
    error's line (what KFP's log then ends with); other errors pass through."""
    from trace_core.rollout.ray_auth import RayAuthError, step_errors

    with pytest.raises(SystemExit) as stopped, step_errors():
        raise RayAuthError("RAY_AUTH_MODE=token but RAY_AUTH_TOKEN is empty")
    assert stopped.value.code == "error: RAY_AUTH_MODE=token but RAY_AUTH_TOKEN is empty"
    assert stopped.value.__cause__ is None and stopped.value.__suppress_context__
    with pytest.raises(ValueError, match="other"), step_errors():
        raise ValueError("other")
    for name in ("open_session", "iterate", "close_session", "release_session"):
        source = (REPO / "components" / f"{name}.py").read_text()
        assert "with step_errors():" in source, name
