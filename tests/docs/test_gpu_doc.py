"""docs/gpu/README.md: its tables are what the GPU check's stored JSON beside it holds
(``docs/gpu/*.json``, each the ``--json`` of ``bash scripts/gpu_check.sh`` on the machine the
page names). The tables are rendered here from the JSON and must appear in the page verbatim:
a figure copied by hand that drifts from its result fails. The check itself runs on this CPU
as ``--smoke`` in ``bench/test_gpu_check.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.commands import commands

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "gpu" / "README.md"
FULL = REPO / "docs" / "gpu" / "2026-12-04-h200.json"
SYNC = REPO / "docs" / "gpu" / "2026-12-04-h200-sync.json"
CONTINUOUS = REPO / "docs" / "gpu" / "2026-12-04-h200-continuous.json"


def stages(path: Path) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in json.loads(path.read_text())["stages"]}


def render_stages(found: dict[str, dict[str, Any]]) -> str:
    update, sync = found["update"], found["sync"]
    env, parity, reload = found["environment"], found["parity"], found["reload"]
    guard, old, decode = found["dtype_guard"], found["old_recompute"], found["decode"]
    rows = [
        ("environment", f"bf16 matmul {env['matmul_tflops']:.0f} TFLOP/s, "
         f"{env['matmul_share']:.0%} of {env['peak_tflops']:.0f}"),
        ("dtype_guard", f"master {guard['master_dtype']}, compute {guard['compute_dtype']}; "
         f"{guard['moved_share']:.0%} of weights move at lr 1e-6 (median step "
         f"{guard['median_step_over_lr']:.3f} × lr), {guard['bf16_moved_share']:.1%} on bf16 "
         f"weights; written {guard['written_dtype']}"),
        ("update", f"Qwen3-8B layers × {update['plain']['layers']}: "
         f"{update['plain']['tokens_per_s']:,.0f} tokens/s, MFU {update['plain']['mfu']:.1%}; "
         f"peak {update['plain']['peak_gib']:.1f} GiB = "
         f"{update['plain']['peak_over_estimate']:.2f} × the estimate "
         f"({update['checkpointing']['peak_over_estimate']:.2f} × with checkpointing)"),
        ("old_recompute", f"largest ρ − 1 {old['max_ratio_error']:g}, clip fraction "
         f"{old['clip_fraction']:g}"),
        ("parity", f"{parity['tokens']:,} tokens: mean gap of logprobs {parity['mean_gap']:.4f}, "
         f"p99 {parity['p99_gap']:.3f}, TIS-truncated {parity['tis_truncated_share']:.1%}"),
        ("decode", "TorchEngine, Qwen3-0.6B shape: " + ", ".join(
            f"batch {b} {decode[f'batch_{b}']['tokens_per_s']:,.0f} tokens/s "
            f"({decode[f'batch_{b}']['ratio']:.1%} of roofline)" for b in (1, 64, 256))),
        ("reload", f"{reload['bytes'] / 1e9:.2f} GB from disk into the GPU at "
         f"{reload['gb_per_s']:.2f} GB/s"),
        ("sync", f"Qwen3-1.7B shape, {sync['weights_gb']:.2f} GB bf16 between two processes: "
         f"{sync['session_backend']} {sync['sync_seconds']:.3f} s ({sync['gb_per_s']:.1f} GB/s)"),
    ]  # fmt: skip
    lines = ["| stage | result | figures |", "|---|---|---|"]
    lines += [f"| {name} | {found[name]['status']} | {text} |" for name, text in rows]
    return "\n".join(lines)


def render_sync(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| run | backend | seconds a sync (median of 3) | GB/s | engine decodes the trainer's "
        "weights |",
        "|---|---|--:|--:|---|",
    ]
    for run, found in runs.items():
        sync = found["sync"]
        for backend in ("cuda-ipc", "gloo", "nccl"):
            figures = sync[backend]
            if "error" in figures:
                why = figures["error"].split("Last error: ")[-1]
                lines.append(f"| {run} | {backend} | refused: {why} | | |")
                continue
            same = "yes" if figures["tokens_match"] and figures["tokens_changed"] else "no"
            lines.append(
                f"| {run} | {backend} | {figures['seconds']:.3f} | {figures['gb_per_s']:.2f} "
                f"| {same} |"
            )
    return "\n".join(lines)


def render_continuous(found: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The continuous-batching section's table and figures."""
    stage, decode = found["continuous"], found["decode"]
    lines = [
        "| run | sub-batches tokens/s | continuous tokens/s | continuous ÷ sub-batches |",
        "|---|--:|--:|--:|",
    ]
    for i, run in enumerate(stage["repeats"], start=1):
        sub, cont = run["sub_batches"], run["continuous"]
        lines.append(
            f"| {i} | {sub['tokens_per_s']:,.0f} | {cont['tokens_per_s']:,.0f} "
            f"| {run['speedup']:.2f}× |"
        )
    low, high = stage["speedup_range"]
    lines.append(f"| median | | | **{stage['speedup']:.2f}×** (range {low:.2f}–{high:.2f}) |")
    last, line = stage["repeats"][-1], stage["step_ms"]
    return {
        "CONTINUOUS_TABLE": "\n".join(lines),
        "STEP_LINE": f"{line['a_ms']:.1f} ms {'+' if line['b_ms_per_row'] >= 0 else '−'} "
        f"{abs(line['b_ms_per_row']):.3f} ms per row",
        "STEPS_SUB": f"{last['sub_batches']['decode_steps']:,}",
        "STEPS_CONT": f"{last['continuous']['decode_steps']:,}",
        "ROWS_CONT": f"{last['continuous']['rows_per_step_while_waiting']:.1f}",
        "ROWS_SUB": f"{last['sub_batches']['rows_per_step_while_waiting']:.1f}",
        "SAME_SHARE": f"{stage['same_tokens_share']:.1%}",
        "AGREE": f"{stage['tokens_before_first_difference']:.1%}",
        "DECODE_LINE": ", ".join(
            f"batch {b} {decode[f'batch_{b}']['tokens_per_s']:,.0f} tokens/s" for b in (1, 64, 256)
        ),
    }


def test_the_page_shows_what_the_stored_runs_hold() -> None:
    page = PAGE.read_text()
    full = stages(FULL)
    assert all(s["status"] == "pass" for s in full.values())
    assert render_stages(full) in page
    runs = {"full check": full, "sync only": stages(SYNC)}
    assert render_sync(runs) in page
    gains = sorted(f["sync"]["cuda-ipc"]["gb_per_s"] / f["sync"]["gloo"]["gb_per_s"]
                   for f in runs.values())  # fmt: skip
    assert f"CUDA IPC is {gains[0]:.0f}–{gains[-1]:.0f}× faster than gloo" in page
    assert "bash scripts/gpu_check.sh --json build/gpu-check.json" in page
    continuous = stages(CONTINUOUS)
    assert all(s["status"] == "pass" for s in continuous.values())
    flat = " ".join(page.split())  # the page's lines wrap anywhere
    for name, text in render_continuous(continuous).items():
        assert " ".join(text.split()) in flat, (name, text)


@pytest.mark.slow  # imports torch in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_pages_command_runs_as_printed_and_needs_a_gpu(tmp_path: Path) -> None:
    """The page's one command, exactly as printed, from a copy of the repository's root: on
    this CPU it stops at once, saying it sees no GPU and how to run the CPU form."""
    (command,) = commands(PAGE.read_text())
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    (tmp_path / "trace_core").symlink_to(REPO / "trace_core")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sees no GPU" in done.stderr and "--smoke" in done.stderr
    assert not (tmp_path / "build").exists()
