"""The GPU check (``scripts/gpu_check.sh``) run as a user runs it: the smoke run on this CPU with
a Python where Ray cannot be imported (a lent GPU machine has no Ray), its JSON, and its refusals.
The GPU run is the same code at real shapes.

Nothing here asserts on how long anything took: figures only have to be present and finite.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest
import torch

from trace_core.bench.gpu_check import STAGES, synthetic_trees
from trace_core.policy.update import tree_paths

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
BIN = Path(sys.executable).parent


def run_script(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``bash scripts/gpu_check.sh ARGS`` with this venv's bin first on PATH, as a user would."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def no_ray(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import Ray: a ``ray`` package first on the path that
    refuses to load, as a missing one would."""
    blocker = tmp_path / "no-ray" / "ray"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError('No module named ray', name='ray')\n"
    )
    return {"PYTHONPATH": str(tmp_path / "no-ray")}


def test_synthetic_trees_are_mixed_groups_of_the_asked_shape() -> None:
    trees = synthetic_trees(3, 4, (5, 7), 100, np.random.default_rng(0))
    assert len(trees) == 3
    paths = tree_paths(trees, "grpo")
    assert len(paths) == 12 and {len(p.tokens) for p in paths} == {12}
    for tree in trees:
        rewards = tree.reward[tree.leaf_mask]
        assert sorted(rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.slow  # imports torch and transformers in a subprocess
def test_the_check_imports_no_ray() -> None:
    code = (
        "import sys, trace_core.bench.gpu_check; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'vllm', 'kfp', 'minio'}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.slow  # every stage at tiny shapes, in a subprocess
def test_smoke_run_passes_without_ray(tmp_path: Path) -> None:
    run = run_script("--smoke", "--json", "gpu.json", cwd=tmp_path, env=no_ray(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    body = json.loads((tmp_path / "gpu.json").read_text())
    assert body["smoke"] is True and body["device"] == "cpu"
    stages = {s["name"]: s for s in body["stages"]}
    assert list(stages) == [name for name, _ in STAGES]
    for name, stage in stages.items():
        assert stage["status"] in ("pass", "skip"), (name, stage)
        assert stage["threshold"], name
        for key, value in stage.items():
            if isinstance(value, float):
                assert math.isfinite(value), (name, key)
    # What runs on a CPU passes on its own terms; what needs CUDA says so.
    assert {n for n, s in stages.items() if s["status"] == "pass"} >= {
        "dtype_guard", "old_recompute", "parity"
    }  # fmt: skip
    assert stages["dtype_guard"]["master_dtype"] == "float32"
    assert stages["dtype_guard"]["written_dtype"] == "bfloat16"
    assert stages["old_recompute"]["clip_fraction"] == 0
    assert stages["decode"]["status"] == "skip" and "roofline" in stages["decode"]["reason"]
    lines = run.stdout.splitlines()
    for name in stages:
        assert any(line.split()[1:2] == [name] or f" {name}" in line for line in lines), name
    assert lines[-1] == "wrote gpu.json; no stage failed"


def test_script_names_the_missing_imports_in_one_line(tmp_path: Path) -> None:
    venv.create(tmp_path / "bare", with_pip=False)
    run = run_script(
        "--smoke", cwd=tmp_path, env={"PYTHON": str(tmp_path / "bare" / "bin" / "python")}
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == ""
    [line] = run.stderr.splitlines()
    assert line.startswith("gpu-check: missing imports in ") and "Traceback" not in run.stderr
    for name in ("torch", "numpy", "transformers", "safetensors"):
        assert f" {name}," in line or line.endswith(f" {name}"), name
    assert "ray" not in line


@pytest.mark.slow  # imports torch in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_run_is_refused_without_a_gpu(tmp_path: Path) -> None:
    run = run_script("--json", "x.json", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    [line] = run.stderr.splitlines()
    assert line.startswith("gpu-check: torch ") and "sees no GPU" in line and "--smoke" in line
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # imports torch in a subprocess
def test_stages_run_in_the_order_asked_and_a_wrong_name_is_refused(tmp_path: Path) -> None:
    run = run_script("--smoke", "--json", "s.json", "--stages", "sync,environment", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    body = json.loads((tmp_path / "s.json").read_text())
    assert [s["name"] for s in body["stages"]] == ["sync", "environment"]
    sync = body["stages"][0]
    # On a CPU both members are CPU processes: the session's backend is gloo, and the engine
    # then decodes what the trainer's weights decode (tokens and logprobs).
    assert sync["session_backend"] == "gloo" and sync["gloo"]["tokens_match"] is True
    assert sync["gloo"]["tokens_changed"] is True and sync["gloo"]["weights_gb"] > 0
    run = run_script("--smoke", "--stages", "sync,nope", cwd=tmp_path)
    assert (
        run.returncode == 2 and "--stages: no stage nope; the stages are environment" in run.stderr
    )
