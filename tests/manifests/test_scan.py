"""checkov on everything a platform team would apply or build, and hadolint on the Dockerfiles.

checkov (pinned in requirements/scan.txt) lives in its own venv, .venv-scan (``make test`` and
``make lint`` create it): it pins packaging and networkx to versions the main venv's tools
break on. It runs once per session over a folder holding every built overlay, the pods of the
RayClusters and Argo workflows as plain Pods (checkov's Kubernetes checks know Pods, not
custom kinds), the tracked manifests (for its secrets scan) and both Dockerfiles.

Run offline, checkov gives no severities (they come from its vendor's service), so every failed
check counts: none may be left, and a check may only be skipped with a reason written beside
it (``checkov.io/skipN`` annotations, ``# checkov:skip=ID: reason`` in a Dockerfile).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import render

CHECKOV = render.REPO / ".venv-scan" / "bin" / "checkov"
HADOLINT = render.REPO / ".venv" / "bin" / "hadolint"
FRAMEWORKS = ("kubernetes", "argo_workflows", "dockerfile", "secrets")
DOCKERFILES = sorted((render.REPO / "images").glob("*/Dockerfile"))


def run_checkov(directory: Path, frameworks: tuple[str, ...]) -> list[Any]:
    offline = ("-o", "json", "--skip-download")  # no call to checkov's vendor
    done = subprocess.run(
        [str(CHECKOV), "-d", str(directory), "--framework", *frameworks, *offline],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
        check=False,
    )
    assert done.stdout.strip(), f"checkov printed nothing:\n{done.stderr[-3000:]}"
    reports = json.loads(done.stdout)
    return reports if isinstance(reports, list) else [reports]


@pytest.fixture(scope="module")
def checkov_reports(built: render.Builds, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Built overlays, their controllers' pods and the Dockerfiles (every framework); the
    tracked sources (secrets only: kustomize sets their namespaces, so they are not scanned as
    objects to apply)."""
    if not CHECKOV.is_file():
        pytest.fail(f"{CHECKOV} is missing: run `make .venv-scan/.installed` (make test does)")
    scan = tmp_path_factory.mktemp("scan")
    for overlay in render.OVERLAYS:
        objects = built[overlay]
        (scan / f"{overlay}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        pods = render.controller_pods(objects)
        (scan / f"{overlay}-pods.yaml").write_text(yaml.safe_dump_all(pods, sort_keys=False))
    for dockerfile in DOCKERFILES:
        copy = scan / "images" / dockerfile.parent.name / "Dockerfile"
        copy.parent.mkdir(parents=True)
        shutil.copyfile(dockerfile, copy)
    sources = tmp_path_factory.mktemp("sources")
    for folder in ("manifests", "images"):
        ignore = shutil.ignore_patterns("*.env")  # a developer's real, untracked env files
        shutil.copytree(render.REPO / folder, sources / folder, ignore=ignore)
    return run_checkov(scan, FRAMEWORKS) + run_checkov(sources, ("secrets",))


def checks(reports: list[Any], kind: str) -> list[dict[str, Any]]:
    return [c for r in reports for c in r.get("results", {}).get(kind, [])]


@pytest.mark.slow  # checkov over every build (≈40 s), from .venv-scan
def test_checkov_ran_every_framework(checkov_reports: list[Any]) -> None:
    passed = {r.get("check_type"): r.get("summary", r)["passed"] for r in checkov_reports}
    assert passed.get("kubernetes", 0) > 100, passed
    assert passed.get("dockerfile", 0) > 20, passed


@pytest.mark.slow  # checkov over every build (≈40 s), from .venv-scan
def test_checkov_finds_nothing(checkov_reports: list[Any]) -> None:
    failed = checks(checkov_reports, "failed_checks")
    assert not failed, "checkov:\n" + "\n".join(
        f"  {c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})" for c in failed
    )


@pytest.mark.slow  # checkov over every build (≈40 s), from .venv-scan
def test_every_skipped_check_says_why(checkov_reports: list[Any]) -> None:
    skipped = checks(checkov_reports, "skipped_checks")
    assert skipped  # the reasons below are the documentation of what is accepted
    for check in skipped:
        reason = (check.get("check_result") or {}).get("suppress_comment", "").strip()
        assert len(reason) > 20 and reason != "No comment provided", (
            f"{check['check_id']} skipped on {check['resource']} without a reason"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint(dockerfile: Path) -> None:
    done = subprocess.run(
        [str(HADOLINT), str(dockerfile)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
