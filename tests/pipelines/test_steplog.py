"""``StepLog``: what `trace-rl run-local` shows on the terminal while KFP's runner prints, fed the
runner's own line formats (colours included) and step folders as a run leaves them."""

from __future__ import annotations

import io
import json
from pathlib import Path

from pipelines.steplog import TAIL_LINES, StepLog

CYAN, RESET = "\x1b[96m", "\x1b[0m"


def started(task: str) -> str:
    return f"23:29:08.051 - INFO - Executing task {CYAN}'{task}'{RESET}\n"


def finished(task: str, status: str = "SUCCESS") -> str:
    return f"23:29:09.051 - INFO - Task {CYAN}'{task}'{RESET} finished with status {status}\n"


def write_metrics(folder: Path, metrics: dict[str, float]) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_one_line_per_step_and_iteration(tmp_path: Path) -> None:
    root = tmp_path / "kfp"
    (root / "older-run" / "iterate").mkdir(parents=True)  # another run's folder: not this one
    log, terminal = io.StringIO(), io.StringIO()
    stream = StepLog(log, terminal, root, 1, tmp_path / "run.log")
    run = root / "trace-training-1"
    write_metrics(
        run / "warmstart" / "policy", {"warmstart_final_loss": 0.41, "warmstart_success": 0.6}
    )
    report = {"pass1": {"all": 0.8}, "mean_k": {"all": 0.432}, "k": 4}
    (run / "open-session").mkdir(parents=True)
    (run / "open-session" / "executor_output.json").write_text(
        json.dumps({"parameterValues": {"Output": json.dumps(report)}})
    )
    iteration = {
        "iteration": 1.0,
        "prompt_effective_ratio": 0.75,
        "mixed_groups": 70.0,
        "tokens": 8123.0,
        "update_loss": -0.0011,
        "accuracy_mean_at_4": 0.45,
    }
    write_metrics(run / "iterate" / "trees", iteration)

    stream.write(started("warmstart") + '    {\n        "executor_input": {\n')
    stream.write("    progress: warm start 300/1000 SFT steps (30%), loss 0.842, ETA 1:3")
    stream.write("6\n" + finished("warmstart"))  # lines arrive in pieces
    for task in ("open-session", "iterate"):
        stream.write(started(task) + "    Streamed logs:\n" + finished(task))
    shown = terminal.getvalue().splitlines()
    assert [" ".join(line.split()[1:]) for line in shown] == [
        "warm start 300/1000 SFT steps (30%), loss 0.842, ETA 1:36",
        "warmstart 0 s SFT loss 0.410, held-out success 0.600",
        "open-session 0 s held-out pass@1 0.800, mean@4 0.432",
        "iterate 0 s",
        "1 (1/1): prompt effective ratio 0.75, mixed groups 70, 8,123 tokens; update loss -0.0011, "
        "held-out mean@4 0.450",
    ], shown
    assert shown[4].split()[:2] == ["iteration", "1"]
    assert "executor_input" in log.getvalue() and "\x1b[96m" in log.getvalue()


def test_a_failed_step_shows_its_last_lines(tmp_path: Path) -> None:
    terminal = io.StringIO()
    stream = StepLog(io.StringIO(), terminal, tmp_path, 2, tmp_path / "run.log")
    stream.write(started("iterate"))
    stream.write("".join(f"    line {i}\n" for i in range(100)))
    stream.write(
        "    ValueError: settings_json: unknown field 'promts'\n" + finished("iterate", "FAILURE")
    )
    shown = terminal.getvalue().splitlines()
    assert shown[0].split()[1:] == ["iterate", "0", "s", "FAILURE;", "its", "last", "lines:"]
    assert len(shown) == 1 + TAIL_LINES + 1
    assert shown[-2] == "    | ValueError: settings_json: unknown field 'promts'"
    assert shown[-1] == f"    (all of its output: {tmp_path / 'run.log'})"
