"""The GPU check (``scripts/gpu_check.sh``): its pieces in process, then the script run as a user
runs it, on the CPU with the small shape (the GPU machine runs the same code with CUDA).

Nothing here asserts on how long anything took: figures only have to be present and positive.
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

from trace_core.bench.gpu_check import (
    SIZES,
    EngineFigures,
    GpuCheckConfig,
    GpuCheckResult,
    build_vocabulary,
    synthetic_trees,
)
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
        ["bash", str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # Ray Train starts in ≈30 s idle, minutes on a loaded 2-core machine
    )


# --- in process ------------------------------------------------------------------------
def test_vocabulary_has_the_asked_size() -> None:
    assert len(build_vocabulary(300)) == 300
    with pytest.raises(ValueError, match="fixed tokens"):
        build_vocabulary(10)


def test_synthetic_trees_are_mixed_groups_of_the_asked_shape() -> None:
    size = SIZES["small"]
    trees = synthetic_trees(size, 300, np.random.default_rng(0))
    assert len(trees) == size.update_prompts
    for tree in trees:
        # A root and `group` one-turn leaves, every other one rewarded: no group is flat.
        assert tree.size == 1 + size.group
        assert len(tree.obs_tokens[0]) == size.update_prompt_tokens
        assert tree.reward[1:].tolist() == [0.0, 1.0] * (size.group // 2)
        assert all(len(t) == size.update_new_tokens for t in tree.gen_tokens[1:])
        assert all(t.min() >= 4 and t.max() < 300 for t in tree.gen_tokens[1:])  # no specials
        # -ln 300 = -5.70: a uniform model's logprob of any token.
        assert np.allclose(np.concatenate(tree.logprobs[1:]), -math.log(300))
    # GRPO gives every path a non-zero advantage (±0.5 / std): all of them are trained on.
    paths = tree_paths(trees, "grpo")
    assert len(paths) == size.update_prompts * size.group
    assert all(np.any(p.advantages != 0) for p in paths)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"device": "tpu"}, "device must be cuda or cpu"), ({"shape": "7b"}, "shape must be one of")],
)
def test_config_rejects_bad_values(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GpuCheckConfig(**kwargs)


def test_result_json_has_the_ratio_once_both_engines_ran() -> None:
    result = GpuCheckResult(config={}, environment={})
    assert result.to_json()["ray_engine"] is None and "ray_over_local" not in result.to_json()
    result.ray_engine = EngineFigures(300.0, 3, 0.01, 1.0, "cpu")
    result.local_engine = EngineFigures(100.0, 1, 0.01, 1.0, "cpu")
    assert result.to_json()["ray_over_local"] == 3.0


# --- the script -------------------------------------------------------------------------
@pytest.mark.slow  # builds a venv without packages (≈2 s)
def test_script_names_the_missing_imports_in_one_line(tmp_path: Path) -> None:
    venv.create(tmp_path / "bare", with_pip=False)
    run = run_script(
        "--device", "cpu", "--small", cwd=tmp_path,
        env={"PYTHON": str(tmp_path / "bare" / "bin" / "python")},
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == ""
    [line] = run.stderr.splitlines()
    assert line.startswith("gpu-check: missing imports in ") and "Traceback" not in run.stderr
    for name in ("torch", "transformers", "pyarrow", "ray", "ray.train.torch"):
        assert f" {name}," in line or line.endswith(f" {name}"), name


@pytest.mark.slow  # imports torch and transformers in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is accepted")
def test_script_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    run = run_script("--small", "--output", "x.json", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "torch.cuda.is_available() is False" in run.stderr and "--device cpu" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # runs trace-rl
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is accepted")
def test_cli_bench_gpu_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(BIN / "trace-rl"), "bench", "gpu", "--small", "--json", "x.json"],
        cwd=tmp_path, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    [line] = run.stdout.splitlines()
    assert line.startswith("error: --device cuda: torch.cuda.is_available() is False"), line
    assert not (tmp_path / "x.json").exists()


ON_GPU = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ],
)


@pytest.mark.slow
@pytest.mark.cluster  # starts Ray in the script's process (≈50 s on 2 cores, most of it Ray Train)
@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_script_writes_the_three_figures(tmp_path: Path, device: str) -> None:
    out = tmp_path / "x.json"
    run = run_script("--device", device, "--small", "--output", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    assert data["config"]["device"] == device and data["config"]["shape"] == "small"
    ray_engine, update, local = data["ray_engine"], data["ray_update"], data["local_engine"]
    size = SIZES["small"]
    for engine in (ray_engine, local):
        assert engine["tokens_per_s"] > 0 and engine["seconds"] > 0
        # No stop token: every row generates exactly new_tokens.
        assert engine["generated_tokens"] == size.prompts * size.samples * size.new_tokens
        # bfloat16 is TorchEngine's default on CUDA; on CPU it keeps the model's float32.
        assert engine["device"].startswith("cuda:0 bfloat16" if device == "cuda" else "cpu float32")
    assert ("Ray GPU ids []" in ray_engine["device"]) == (device == "cpu")
    assert update["seconds"] > 0 and update["peak_gib"] > 0
    assert update["use_gpu"] == (device == "cuda")
    assert update["paths"] == size.update_prompts * size.group and update["steps"] >= 1
    assert data["ray_over_local"] > 0
    for name in ("ray_engine", "ray_update", "local_engine"):  # one figure line per check
        assert sum(line.startswith(f"{name}: ") for line in run.stdout.splitlines()) == 2, name
    assert "tokens/s" in run.stdout and "peak" in run.stdout and "FAIL" not in run.stdout
