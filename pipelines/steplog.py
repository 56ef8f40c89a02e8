"""What ``trace-rl run-local`` shows while KFP's local runner works: one line per step and per
iteration, and the progress lines of a long step; everything the runner prints (each step's
output, KFP's executor JSON) goes to a log file instead.

       5:18  warmstart             318 s  SFT loss 0.412, held-out success 0.610
       5:35  open-session           17 s  held-out pass@1 0.800, mean@4 0.432
       6:07  iterate                32 s
             iteration 1 (1/6): prompt effective ratio 0.75, mixed groups 70, 8,123 tokens;
             update loss -0.0123, held-out mean@4 0.440

KFP's runner prints to ``sys.stdout``, so ``run_local`` puts a ``StepLog`` there for the run:
it writes every line to the log and reads the runner's "Executing task" and "finished with
status" lines, the steps' ``progress:`` lines (``trace_core.train.progress``), and each
finished step's metrics from its artifact folder.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from trace_core.train.progress import PREFIX, clock_text

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXECUTING = re.compile(r"Executing task '([^']+)'")
_FINISHED = re.compile(r"Task '([^']+)' finished with status (\w+)")
TAIL_LINES = 25
"""Lines of a failed step's output shown on the terminal (all of it is in the log)."""


class StepLog(io.TextIOBase):
    """A text stream for ``sys.stdout`` during a ``kfp.local`` run (see the module)."""

    def __init__(
        self, log: TextIO, terminal: TextIO, root: Path, iterations: int, log_path: Path
    ) -> None:
        self.log, self.terminal, self.root, self.iterations = log, terminal, root, iterations
        self.log_path = log_path
        self.live = terminal.isatty()
        self._before = set(root.iterdir()) if root.is_dir() else set()
        self._partial = ""
        self._start = time.monotonic()
        self._task: str | None = None
        self._task_start = self._start
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._updates = 0
        self._progress_shown = False
        self._reported: set[Path] = set()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.log.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(_ANSI.sub("", line))
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.terminal.flush()

    def _line(self, line: str) -> None:
        if match := _EXECUTING.search(line):
            self._task, self._task_start = match[1], time.monotonic()
            self._tail.clear()
        elif match := _FINISHED.search(line):
            self._finished(match[1], match[2])
        elif PREFIX in line:
            self._progress(line.split(PREFIX, 1)[1].strip())
        elif self._task is not None:
            self._tail.append(line)

    def _say(self, line: str) -> None:
        if self._progress_shown:  # the live progress line gives way
            self.terminal.write("\r\x1b[K")
            self._progress_shown = False
        self.terminal.write(line + "\n")
        self.terminal.flush()

    def _progress(self, text: str) -> None:
        line = f"{clock_text(time.monotonic() - self._start):>8}  {text}"
        if self.live:
            self.terminal.write(f"\r\x1b[K{line}")
            self.terminal.flush()
            self._progress_shown = True
        else:
            self._say(line)

    def _finished(self, task: str, status: str) -> None:
        now = time.monotonic()
        seconds = now - self._task_start if task == self._task else 0.0
        head = f"{clock_text(now - self._start):>8}  {task:<20} {seconds:5.0f} s"
        if status != "SUCCESS":
            self._say(f"{head}  {status}; its last lines:")
            for line in self._tail:
                self._say(f"    | {line.strip()}")
            self._say(f"    (all of its output: {self.log_path})")
            return
        folder = self._task_folder(task)
        detail, iteration_line = self._figures(task, folder) if folder else ("", "")
        self._say(f"{head}  {detail}".rstrip())
        if iteration_line:
            self._say(f"{'':8}  {iteration_line}")
        self._task = None

    def _task_folder(self, task: str) -> Path | None:
        """``task``'s folder in this run's KFP folder (the one made after the run began); a
        task of the iterations' loop has one per iteration (``for-loop-N-iteration-I/task``):
        the one not reported yet."""
        runs = [p for p in self.root.iterdir() if p.is_dir() and p not in self._before]
        folders = [
            folder
            for run in runs
            for folder in (run / task, *run.glob(f"*/{task}"))
            if folder.is_dir() and folder not in self._reported
        ]
        if len(folders) != 1:
            return None
        self._reported.add(folders[0])
        return folders[0]

    def _figures(self, task: str, folder: Path) -> tuple[str, str]:
        """(what the step's line shows, the iteration's line after an update or '')."""
        step = re.sub(r"-\d+$", "", task)
        if step == "warmstart":
            m = _metrics(folder / "policy")
            return (
                f"SFT loss {m.get('warmstart_final_loss', float('nan')):.3f}, held-out success "
                f"{m.get('warmstart_success', float('nan')):.3f}",
                "",
            )
        if step in ("open-session", "close-session"):
            report = _output(folder)
            pass1, mean_k, k = report.get("pass1", {}), report.get("mean_k", {}), report.get("k")
            text = f"held-out pass@1 {pass1['all']:.3f}" if "all" in pass1 else ""
            if "all" in mean_k:
                text += f", mean@{k} {mean_k['all']:.3f}"
            return text, ""
        if step == "iterate":
            m = _metrics(folder / "trees")
            self._updates += 1
            iteration = int(m.get("iteration", 0))
            line = f"iteration {iteration} ({self._updates}/{self.iterations}):"
            if "prompt_effective_ratio" in m:
                line += (
                    f" prompt effective ratio {m['prompt_effective_ratio']:.2f}, mixed groups "
                    f"{int(m['mixed_groups'])}, {int(m['tokens']):,} tokens;"
                )
            line += f" update loss {m.get('update_loss', float('nan')):.4f}"
            if "accuracy_mean_at_" in " ".join(m):
                key = next(k for k in m if k.startswith("accuracy_mean_at_"))
                line += f", held-out mean@{key.rsplit('_', 1)[1]} {m[key]:.3f}"
            return "", line
        return "", ""


def _metrics(folder: Path) -> dict[str, float]:
    path = folder / "metrics.json"
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _output(folder: Path) -> dict[str, Any]:
    """The step's returned string (its ``Output`` parameter) as JSON, or {}."""
    path = folder / "executor_output.json"
    if not path.is_file():
        return {}
    value = json.loads(path.read_text()).get("parameterValues", {}).get("Output")
    return dict(json.loads(value)) if isinstance(value, str) else {}
