"""The task, warm-start, demo and engine-bench commands, run as the real ``trace-rl`` script.

Tiny budgets only; nothing asserts on how long anything took (timings need only be positive).
Subprocesses run with one OpenMP thread: on a shared CPU, idle workers cost more than they give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from support.commands import run_tree_commands

pytestmark = pytest.mark.slow  # every test starts trace-rl (a fresh Python; ≈2-120 s each)

CALC_LABELS = [f"ops={o},digits={d}" for o in (1, 2, 3) for d in (1, 2, 3)]


def trace_rl(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``trace-rl`` (the console script beside this Python, else ``python -m``)."""
    script = Path(sys.executable).with_name("trace-rl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trace_core.cli"]
    # A wide terminal so rich neither wraps table cells nor error messages.
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def said(run: subprocess.CompletedProcess[str]) -> str:
    """Everything the command printed, with line wrapping undone."""
    return " ".join((run.stdout + run.stderr).split())


# --- trace-rl task check -------------------------------------------------------------------------


def test_task_check_calc_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    run = trace_rl("task", "check", "calc", "--json", str(out), cwd=tmp_path)
    assert run.returncode == 0, said(run)
    data = json.loads(out.read_text())
    assert data == {
        "task": "calc",
        "tasks": 2200,  # 2000 train + 200 eval
        "mean_reward": 1.0,
        "without_reference": 0,
        "by_difficulty": dict.fromkeys(CALC_LABELS, 1.0),
        "failed": [],
    }
    assert "calc: 2200 reference episodes" in said(run) and f"wrote {out}" in said(run)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["task", "check", "nope"],
            "unknown task 'nope'; "
            "choose one of calc, calc-mix, multihop, bfcl, deepscaler, hotpotqa",
        ),
        (["task", "check", "deepscaler"], "task 'deepscaler' reads a dataset"),
        (
            ["warmstart", "--task", "bfcl"],
            "warm start needs a synthetic task (calc, calc-mix, multihop)",
        ),
    ],
    ids=["unknown-task", "missing-data", "warmstart-task"],
)
def test_bad_tasks_are_refused_plainly(args: list[str], message: str, tmp_path: Path) -> None:
    run = trace_rl(*args, cwd=tmp_path)
    assert run.returncode == 2, said(run)
    assert message in said(run)
    assert "Traceback" not in said(run)
    assert not any(tmp_path.iterdir())  # nothing written, nothing warm-started


# --- trace-rl warmstart, then rollout-demo on its checkpoint -------------------------------------


@dataclass(frozen=True)
class Warmstarted:
    run: subprocess.CompletedProcess[str]
    checkpoint: Path
    report: Path
    cwd: Path


@pytest.fixture(scope="module")
def warmstarted(tmp_path_factory: pytest.TempPathFactory) -> Warmstarted:
    cwd = tmp_path_factory.mktemp("cli")
    checkpoint, report = cwd / "policy", cwd / "warmstart.json"
    run = trace_rl(
        "warmstart", "--task", "calc", "--output", str(checkpoint), "--steps", "5",
        "--demos", "50", "--eval-tasks", "18", "--eval-samples", "2", "--json", str(report),
        cwd=cwd, timeout=300,
    )  # fmt: skip
    return Warmstarted(run, checkpoint, report, cwd)


def test_warmstart_command(warmstarted: Warmstarted) -> None:
    run = warmstarted.run
    assert run.returncode == 0, said(run)[-2000:]
    data = json.loads(warmstarted.report.read_text())
    assert set(data) == {
        "task",
        "checkpoint",
        "steps",
        "final_loss",
        "train_seconds",
        "demo_success",
        "success",
        "success_all",
        "parse_rate",
        "success_all_before",
        "parse_rate_before",
    }
    assert 0 <= data["parse_rate"] <= 1 and 0 <= data["success_all"] <= 1
    assert data["success_all_before"] is None and data["parse_rate_before"] is None  # no --init
    assert (data["task"], data["checkpoint"], data["steps"]) == (
        "calc",
        str(warmstarted.checkpoint),
        5,
    )
    assert list(data["success"]) == CALC_LABELS
    # The eval success is the saved policy's: sampled again from the checkpoint on the same 18
    # eval tasks, 2 samples each, seed 0, one thread as the command had. (A 5-step policy
    # scores 0 almost everywhere; this checks what was evaluated, not how well.)
    import torch

    from trace_core.policy.format import TurnFormat
    from trace_core.policy.model import load_checkpoint
    from trace_core.policy.torch_engine import TorchEngine
    from trace_core.train.warmstart import success_by_difficulty, synthetic_suite

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load_checkpoint(warmstarted.checkpoint)
        suite = synthetic_suite("calc", 0)
        engine, fmt, tasks = TorchEngine(model), TurnFormat(tokenizer), suite.tasks("eval")[:18]
        assert data["success"] == success_by_difficulty(engine, fmt, suite, tasks, 2, 0)
    finally:
        torch.set_num_threads(threads)
    # The table prints both columns of the JSON, row by row.
    for label in CALC_LABELS:
        row = f"{label} │ {data['demo_success'][label]:.2f} │ {data['success'][label]:.2f} │"
        assert row in said(run), label
    assert "calc warm start: 5 steps" in said(run)


def test_warmstart_checkpoint_feeds_the_rollout_demo(warmstarted: Warmstarted) -> None:
    # The checkpoint is written before the eval runs, so it is there whatever the eval did.
    assert (warmstarted.checkpoint / "config.json").exists(), said(warmstarted.run)[-2000:]
    assert (warmstarted.checkpoint / "model.safetensors").exists()
    run = trace_rl(
        "rollout-demo", "--task", "calc", "--checkpoint", str(warmstarted.checkpoint),
        "--prompts", "2", "--samples", "1",
        cwd=warmstarted.cwd,
    )  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    text = said(run)
    assert "no policy at" not in text  # it used the checkpoint, it did not warm-start one
    # Two eval tasks, one episode each: two prompts, two rewards.
    assert text.count("prompt:") == 2 and text.count("reward") == 2
    assert "agent:" in text and "env:" in text
    assert "calc-eval-00000" in text and "calc-eval-00001" in text


# --- trace-rl model upload ----------------------------------------------------------------------


@pytest.mark.cluster  # the session's SeaweedFS
def test_model_upload_puts_the_folder_once_and_refuses_what_base_model_uri_cannot_read(
    tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Every file to the prefix and the ``--param`` line that names it (a step takes it as
    printed: train/test_step_cli.py); again to the same prefix, a folder with pickled weights,
    a folder without config.json: one error line each, and nothing stored or overwritten."""
    import shutil

    from trace_core.envs.calc import CalcSuite
    from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
    from trace_core.policy.tokenizer import build_word_tokenizer
    from trace_core.store.artifacts import open_store

    model = tmp_path / "model"
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    small = TinyPolicyConfig(
        hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32
    )
    save_checkpoint(create_policy(tokenizer, small, seed=0), tokenizer, model)
    uri = f"s3://trace/cli-upload-{os.getpid()}/model"
    run = trace_rl("model", "upload", str(model), uri, cwd=tmp_path)
    assert run.returncode == 0, said(run)
    files = {p.relative_to(model).as_posix(): p.stat().st_size for p in model.rglob("*")}
    stored = {o.key: o.size for o in open_store(uri).list_objects("")}
    assert stored == files and "model.safetensors" in stored
    assert f"uploaded {len(files)} files " in said(run) and f" to {uri}" in said(run)
    assert f"\n  --param base_model_uri={uri}\n" in run.stdout

    again = trace_rl("model", "upload", str(model), uri, cwd=tmp_path)
    pickled = tmp_path / "pickled"
    shutil.copytree(model, pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    no_config = tmp_path / "no-config"
    shutil.copytree(model, no_config)
    (no_config / "config.json").unlink()
    cases = [
        (again, f"error: {uri} already holds {len(files)} file(s)"),
        (
            trace_rl("model", "upload", str(pickled), f"{uri}-2", cwd=tmp_path),
            f"error: DIR {pickled} holds pickled weights (pytorch_model.bin)",
        ),
        (
            trace_rl("model", "upload", str(no_config), f"{uri}-2", cwd=tmp_path),
            f"error: {no_config} is not a model checkpoint: it has no config.json",
        ),
    ]
    for refused, line in cases:
        assert refused.returncode == 2 and "Traceback" not in said(refused), said(refused)
        assert said(refused).startswith(line), said(refused)
    assert {o.key: o.size for o in open_store(uri).list_objects("")} == stored
    assert open_store(f"{uri}-2").list_objects("") == []


# --- trace-rl bench engine -----------------------------------------------------------------------


def test_bench_engine_json(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    flags = ["--batch", "4", "--new-tokens", "8", "--threads", "2", "--profile", "--json"]
    run = trace_rl("bench", "engine", *flags, str(out), cwd=tmp_path)
    assert run.returncode == 0, said(run)[-2000:]
    data = json.loads(out.read_text())
    for key in (
        "torch_tokens_per_s",
        "hf_tokens_per_s",
        "ratio_vs_hf",
        "floor_seconds",
        "floor_ratio_vs_hf",
        "torch_vs_floor",
        "prefill_tokens",
        "unique_tokens",
    ):
        assert isinstance(data[key], (int, float)) and data[key] > 0, key
    assert data["batch"] == 4 and data["new_tokens"] == 8
    # The median of the repeats' paired ratios, within their spread.
    assert data["ratio_vs_hf_min"] <= data["ratio_vs_hf"] <= data["ratio_vs_hf_max"]
    assert data["floor_ratio_vs_hf"] == pytest.approx(data["hf_seconds"] / data["floor_seconds"])
    assert data["torch_vs_floor"] == pytest.approx(data["torch_seconds"] / data["floor_seconds"])
    # Two threads: two replicas, timed against the same engine in one process.
    assert data["threads"] == data["replicas"] == 2
    low, mid, high = (data[f"ratio_vs_one_process{s}"] for s in ("_min", "", "_max"))
    assert 0 < low <= mid <= high and data["one_process_tokens_per_s"] > 0
    assert "Tiny policy, batch 4 × 8 new tokens" in said(run)
    assert "vLLM: not timed (--vllm-python" in said(run) and "vllm_seconds" not in data
    # --profile: the tiny policy's 2 layers, each op of a step in its part by what called it.
    layers = 2
    assert data["profile_decode_steps"] == 8
    assert data["profile_matmuls_ops_per_step"] == 4 * layers + 2  # 4 a layer; the head, its cast
    assert data["profile_attention_ops_per_step"] == 3 * layers  # scores, softmax, values
    assert data["profile_norms_ops_per_step"] == 4 * (3 * layers + 1)  # in, q/k, post; final
    assert data["profile_kv_writes_ops_per_step"] == 2 * layers
    for part in ("sampling", "bookkeeping", "admission", "retirement"):
        assert data[f"profile_{part}_ops_per_step"] > 0, part
    assert data["profile_wall_us_per_step"] > 0 and data["profile_outside_ops_us_per_step"] > 0
    assert "a TorchEngine decode step, batch 4 × 8 new tokens" in said(run)


def test_bench_engine_names_a_missing_vllm_python(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "python"
    run = trace_rl("bench", "engine", "--batch", "2", "--new-tokens", "2",
                   "--vllm-python", str(missing), cwd=tmp_path)  # fmt: skip
    assert run.returncode != 0
    assert f"vllm_python: {missing} is not a file" in said(run)


# --- trace-rl prep / rollout --prompt-file / train / compare -----------------------------------


def test_prep_then_rollout_from_the_prompt_file(warmstarted: Warmstarted, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.parquet"
    run = trace_rl("prep", "--task", "calc", "--split", "eval", "--limit", "6",
                   "--output", str(prompts), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    assert "wrote 6 calc eval prompts" in said(run)
    trees, metrics = tmp_path / "trees.parquet", tmp_path / "metrics.json"
    run = trace_rl(
        "rollout", "--checkpoint", str(warmstarted.checkpoint), "--prompt-file", str(prompts),
        "--strategy", "grpo", "--budget", "4", "--continuations", "2", "--group", "2",
        "--max-tokens", "8", "--output", str(trees), "--metrics", str(metrics),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    from trace_core.store.schema import read_trees

    rolled = read_trees(trees)
    assert len(rolled) == 4  # 4 roots x (1 + 2/2) = 8 units = 4 groups of 2
    assert {t.info.prompt_id for t in rolled} <= {f"calc-eval-{i:05d}" for i in range(6)}
    # Fit a predictor on those trees and let it steer a trace rollout.
    predictor = tmp_path / "predictor"
    run = trace_rl("predictor", "fit", "--trees", str(trees), "--output", str(predictor),
                   "--checkpoint", str(warmstarted.checkpoint), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    run = trace_rl(
        "rollout", "--checkpoint", str(warmstarted.checkpoint), "--prompt-file", str(prompts),
        "--predictor", str(predictor), "--strategy", "trace", "--budget", "4",
        "--max-tokens", "8", "--output", str(trees), "--metrics", str(metrics),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    scored = read_trees(trees)
    assert all(np.isfinite(t.predicted_v[0]) and t.predicted_v[0] != 0.5 for t in scored)


def test_train_smoke_writes_log_and_plot(warmstarted: Warmstarted, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = trace_rl(
        "train", "--init", str(warmstarted.checkpoint), "--output", str(out),
        "--strategy", "trace", "--iterations", "2", "--budget", "4", "--prompts", "8",
        "--eval-tasks", "3", "--eval-k", "1", "--eval-every", "1", "--threads", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    lines = (out / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "latest").read_text().strip() == "2"
    assert "held-out success before and after" in said(run)
    assert "change (95% interval)" in said(run) and "each of the 3 tasks" in said(run)
    # The run's summary, as the pipeline's report writes it: its commands run as printed.
    summary = (out / "summary.md").read_text()
    assert "## Held-out accuracy" in summary and "| change (95% interval) |" in summary
    assert all(f"| {i} | `{out}/iterations/000{i}/trees.parquet` |" in summary for i in (1, 2))
    done = run_tree_commands(summary, tmp_path)
    assert (tmp_path / "trees.html").read_text().count('<section class="tree"') >= 1
    assert "trace" in done.stdout, done.stdout  # the query: iteration 2, strategy trace


@pytest.mark.slow  # a short warm start and one iteration of one arm
def test_a_comparison_never_starts_from_another_tasks_warm_start(tmp_path: Path) -> None:
    """`compare --task calc`, then `compare --task calc-mix --first-seed 11` into the same
    --output: the second is refused with one line naming what differs, before any arm starts,
    and the first's warm start is left as it was."""
    out = tmp_path / "compare"
    small = "--strategies grpo --seeds 1 --iterations 1 --budget 4 --prompts 8 --eval-tasks 3"
    small += " --eval-k 1 --parallel 1"
    small += f" --output {out} --plot {tmp_path / 'compare.png'}"
    first = trace_rl(*f"compare --task calc --warmstart-steps 20 {small}".split(), cwd=tmp_path)
    assert first.returncode == 0, said(first)[-2000:]
    record = (out / "warmstart" / "warmstart.json").read_bytes()
    second = trace_rl(*f"compare --task calc-mix --first-seed 11 {small}".split(), cwd=tmp_path)
    assert second.returncode == 2, said(second)[-2000:]
    errors = [line for line in second.stdout.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {out / 'warmstart'} holds the warm start made with task calc, sft.steps 20; "
        "this comparison (--task calc-mix) needs task calc-mix, sft.steps 2000: use another "
        f"output folder, or remove {out / 'warmstart'}"
    ], said(second)[-2000:]
    assert not (out / "grpo" / "seed-11").exists()  # no arm started
    assert (out / "warmstart" / "warmstart.json").read_bytes() == record


@pytest.mark.cluster  # the session's MLflow server
def test_compare_smoke_json_shape(
    warmstarted: Warmstarted, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)  # each arm: an MLflow run of its own
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "compare-smoke")
    out = tmp_path / "compare.json"
    run = trace_rl(
        "compare", "--init", str(warmstarted.checkpoint), "--output", str(tmp_path / "runs"),
        "--strategies", "trace,grpo", "--seeds", "1", "--iterations", "1", "--budget", "4",
        "--prompts", "8", "--eval-tasks", "3", "--eval-k", "1", "--parallel", "1",
        "--json", str(out), "--plot", str(tmp_path / "compare.png"),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, said(run)[-2000:]
    data = json.loads(out.read_text())
    assert set(data["strategies"]) == {"trace", "grpo"}
    for metric in ("accuracy", "prompt_effective_ratio", "anchor_effective_ratio", "tokens"):
        assert set(data["strategies"]["trace"][metric]) == {"mean", "std", "lo", "hi", "n"}
    assert data["interval"] == "95% Student t over seeds"
    assert set(data["paired_vs_grpo"]) == {"trace"}
    assert "paired against grpo, seed by seed" in said(run)
    # One seed, one iteration: grpo's log has its evaluations at 0 tokens and at the end, and
    # it reaches its own final accuracy at 0 tokens when it started there (or higher), else at
    # its last evaluation: the ratio is 0.0 or 1.0, and which one the log says.
    log = (tmp_path / "runs" / "grpo" / "seed-0" / "log.jsonl").read_text().splitlines()
    start, final = (json.loads(line) for line in log)
    started_there = start["eval"]["mean_k"]["all"] >= final["eval"]["mean_k"]["all"]
    grpo = data["strategies"]["grpo"]
    assert grpo["tokens_to_grpo_final"]["mean"] == (0.0 if started_there else 1.0)
    assert grpo["tokens"]["mean"] == final["total_tokens"]
    assert grpo["accuracy"]["mean"] == final["eval"]["mean_k"]["all"]
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    # MLflow holds each arm as its own run, tagged with the comparison, side by side.
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("compare-smoke")
    assert experiment is not None
    arms = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(arms) == {"trace seed 0", "grpo seed 0"}
    assert {r.data.tags["trace.compare"] for r in arms.values()} == {"runs"}
    assert {r.info.status for r in arms.values()} == {"FINISHED"}
    assert arms["grpo seed 0"].data.metrics["eval/mean_at_1"] == pytest.approx(
        final["eval"]["mean_k"]["all"]
    )
    # The stored result prints again, as Markdown too, without training anything.
    again = trace_rl(
        "compare", "--from-json", str(out), "--markdown", str(tmp_path / "compare.md"),
        "--plot", str(tmp_path / "again.png"), cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, said(again)[-2000:]
    text = (tmp_path / "compare.md").read_text()
    assert f"| `grpo` | {grpo['accuracy']['mean']:.3f} |" in text
    assert "Paired against grpo" in text and "| `trace` |" in text
    assert not (tmp_path / "runs" / "trace" / "seed-1").exists()
    refused = trace_rl("compare", "--from-json", str(out), "--table", "shape", cwd=tmp_path)
    assert refused.returncode == 2 and "not a --table shape result" in said(refused)
