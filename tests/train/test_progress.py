"""``LineProgress``: plain progress lines for logs, rate-limited, always the last one."""

from __future__ import annotations

import pytest

from trace_core.train.progress import PREFIX, LineProgress, clock_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_every_interval_and_the_last() -> None:
    clock, lines = Clock(), []
    bar = LineProgress("warm start", 100, "SFT steps", every=10, write=lines.append, clock=clock)
    for done in range(1, 101):
        clock.now += 0.5  # 50 s in all: a line at 10 s, 20 s, 30 s, 40 s, and the last
        bar(done, loss=1 / done)
    assert len(lines) == 5 and all(line.startswith(PREFIX) for line in lines)
    assert lines[0] == (
        "progress: warm start 20/100 SFT steps (20%), loss 0.050, 0:10 elapsed, ETA 0:40"
    )
    assert lines[-1] == "progress: warm start 100/100 SFT steps (100%), loss 0.010, 0:50 elapsed"
    bar(100, loss=0.01)  # called again at the end (a rollout's last engine calls): no new line
    assert len(lines) == 5
    bar.note("evaluating 8 held-out tasks")
    assert lines[-1] == "progress: warm start: evaluating 8 held-out tasks (0:50 elapsed)"


def test_clock_text_and_bad_total() -> None:
    assert [clock_text(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]
    with pytest.raises(ValueError, match="total must be >= 1"):
        LineProgress("x", 0, "steps")
