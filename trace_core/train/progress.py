"""Progress of a long step as plain lines, for output that is a log, not a terminal (a pipeline
pod, a step of ``trace-rl run-local``):

    progress: warm start 300/1000 SFT steps (30%), loss 0.842, 0:41 elapsed, ETA 1:36

At most one line every ``every`` seconds, and always the last one. ``trace-rl run-local`` shows
these lines on the terminal while the step runs (``PREFIX`` is how it finds them).
"""

from __future__ import annotations

import time
from collections.abc import Callable

PREFIX = "progress: "


def clock_text(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class LineProgress:
    """``progress(done, loss=0.8)`` after each unit of work; prints a line when due."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        every: float = 15.0,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 1:
            raise ValueError(f"progress of {what!r}: total must be >= 1, got {total}")
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self._write = write or (lambda line: print(line, flush=True))
        self._clock = clock
        self._start = clock()
        self._last = self._start  # the first line after `every` seconds: step 1 is warm-up
        self._done = False  # the last line is printed once

    def __call__(self, done: int, **figures: float) -> None:
        now = self._clock()
        finished = done >= self.total
        if self._done or (not finished and now - self._last < self.every):
            return
        self._last, self._done = now, finished
        elapsed = now - self._start
        parts = [f"{self.what} {done}/{self.total} {self.unit} ({100 * done // self.total}%)"]
        parts += [f"{name.replace('_', ' ')} {value:.3f}" for name, value in figures.items()]
        parts.append(f"{clock_text(elapsed)} elapsed")
        if 0 < done < self.total:
            parts.append(f"ETA {clock_text(elapsed / done * (self.total - done))}")
        self._write(PREFIX + ", ".join(parts))

    def note(self, message: str) -> None:
        """A line about what the step does next (``evaluating 200 held-out tasks``)."""
        elapsed = clock_text(self._clock() - self._start)
        self._write(f"{PREFIX}{self.what}: {message} ({elapsed} elapsed)")
