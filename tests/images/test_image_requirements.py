"""Both images' pins against every requirement their packages declare, read from the wheels'
metadata on PyPI for the image's platform and Python (``image_requirements``; cached under
build/image-requirements, so only a first run reads the network)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import image_requirements as images

pytestmark = pytest.mark.slow  # the first run reads a few hundred documents from PyPI

CHECKER = Path(images.__file__)


@pytest.mark.parametrize("image", ["gpu", "cpu"])
def test_the_image_resolves(image: str) -> None:
    report = images.check(image)
    assert report.ok, "\n".join(report.failures)
    assert len(report.packages) > 100  # transitively: far past the project's own requirements
    if image == "gpu":
        assert str(report.packages["vllm"]) == "0.33.0"
        assert "mistral-common" in report.packages  # chosen, not pinned


def test_the_locks_numpy_under_vllm_is_named_with_the_requirement_and_the_pin() -> None:
    constraints = images.gpu_constraints()
    with_lock_numpy = "\n".join(
        "numpy==2.4.6" if line.startswith("numpy==") else line for line in constraints.splitlines()
    )
    report = images.check("gpu", with_lock_numpy)
    assert len(report.failures) == 1, report.failures
    failure = report.failures[0]
    assert failure.startswith("mistral-common>=1.11.6 (required by vllm 0.33.0)")
    assert "requires numpy<2.4" in failure and "the pin is numpy==2.4.6" in failure


def test_a_pin_outside_a_requirement_is_named() -> None:
    constraints = images.gpu_constraints().replace("transformers==5.20.2", "transformers==5.24.0")
    failures = images.check("gpu", constraints).failures
    assert any(
        f.startswith("transformers: vllm 0.33.0 requires transformers")
        and f.endswith("the pin is transformers==5.24.0")
        for f in failures
    ), failures


def test_the_command_prints_its_verdict() -> None:
    run = subprocess.run(
        [sys.executable, str(CHECKER), "gpu"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("trace-gpu: ")
    assert run.stdout.strip().endswith("packages checked; resolves")
