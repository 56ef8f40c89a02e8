"""The GPU image's package as its Dockerfile installs it, as tests/images/test_image_context.py
checks the CPU image's (``support.image_context``): the build context as docker sends it, the
Dockerfile's COPY steps, that tree's wheel installed into a venv that cannot see the checkout.
The requirements come from this environment (.venv-vllm: vLLM's CPU build stands in for the
image's CUDA one), so the Dockerfile's own import check, vLLM included, runs there, and so does
the image's CMD."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from support.image_context import REPO, ImageVenv, command, import_check, user_env

pytestmark = pytest.mark.slow  # a wheel and a venv the first time; importing vLLM

DOCKERFILE = REPO / "images" / "trace-gpu" / "Dockerfile"


def test_the_gpu_image_passes_its_own_import_check(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    venv = installed_image("trace-gpu")
    check = import_check(DOCKERFILE)  # RUN python3 -c "import trace_core.cli, ray, vllm"
    assert "trace_core.cli" in check[-1] and "vllm" in check[-1]
    done = venv.run(check, cwd=tmp_path, env=user_env(tmp_path), timeout=600)
    assert done.returncode == 0, f"{check} in {venv.prefix}:\n{done.stderr[-3000:]}"


def test_the_gpu_image_runs_its_command(
    installed_image: Callable[[str], ImageVenv], tmp_path: Path
) -> None:
    venv = installed_image("trace-gpu")
    cmd = command(DOCKERFILE)  # CMD ["trace-rl", "--help"]
    assert (venv.prefix / "bin" / cmd[0]).is_file(), cmd
    done = venv.run(cmd, cwd=tmp_path, env=user_env(tmp_path))
    assert done.returncode == 0, f"{cmd} in {venv.prefix}:\n{done.stderr[-3000:]}"
    assert "Usage:" in done.stdout, done.stdout
