"""``BatchLoop``: an engine actor's continuous batch, stepped by a thread of its own, fed and
drained by calls (the actor side of the continuous driver, ``rollout.ray_continuous``).

    loop = BatchLoop(torch_engine)
    loop.submit([(turn_id, prompt, seed), ...], params)   # joins the running batch
    got = loop.collect(wait_s=1.0)                         # the turns answered since, at once

``submit`` returns at once: its turns wait for the next step boundary, where the batch admits
them while rows are free (``policy.continuous``). The thread steps the batch while anything is
pending and sleeps otherwise. ``collect`` blocks until some turn has all its samples (or
``wait_s`` passes) and hands back every such turn with the engine's counters since the last
collect, so the driver handles completions as they arrive. A step that raises stops the loop;
the next ``collect`` raises it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from trace_core.policy.continuous import ContinuousBatch, Request
from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.sampling import request_keys
from trace_core.policy.torch_engine import TorchEngine


@dataclass(frozen=True)
class Collected:
    """Turns an engine answered since the last ``collect``, and what that took."""

    ids: list[int]
    completions: list[list[Completion]]
    """Each turn's ``params.n`` samples, in sample order."""
    prompt_tokens: int
    prefill_tokens: int
    generated_tokens: int
    seconds: float
    """Time spent stepping the batch."""
    cache_used_tokens: float
    steps: int
    """Decode steps run."""
    row_steps: int
    """Rows in flight summed over those steps (their mean: ``row_steps / steps``)."""


class BatchLoop:
    """A ``TorchEngine``'s ``ContinuousBatch`` behind a lock, stepped by a daemon thread."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.batch = ContinuousBatch(engine)
        self._cond = threading.Condition()
        self._done: list[tuple[int, list[Completion]]] = []
        self._partial: dict[int, list[Completion | None]] = {}
        self._error: BaseException | None = None
        self._running = False  # a thread steps the batch (set and cleared under the lock)
        self._seconds = 0.0
        self._marks = self._counters()

    def submit(
        self, turns: Sequence[tuple[int, Sequence[int], int]], params: SamplingParams
    ) -> None:
        """Queue turns (id, prompt, seed), ``params.n`` samples each; sample ``j`` of a turn
        draws with ``request_keys([seed], n)[j]``, as ``TorchEngine.generate`` would."""
        one = replace(params, n=1)
        with self._cond:
            if self._error is not None:
                raise self._error
            for turn, prompt, seed in turns:
                tokens = tuple(int(t) for t in prompt)
                self._partial[turn] = [None] * params.n
                self.engine.stats.prompt_tokens += len(tokens)
                for j, key in enumerate(request_keys([seed], params.n)):
                    self.batch.add(Request(tokens, one, key), (turn, j))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, daemon=True).start()

    def collect(self, wait_s: float) -> Collected:
        """The turns answered since the last call; waits up to ``wait_s`` for the first."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._error is not None, timeout=wait_s)
            if self._error is not None:
                raise self._error
            done, self._done = self._done, []
            now = self._counters()
            delta = [a - b for a, b in zip(now, self._marks, strict=True)]
            self._marks = now
            seconds, self._seconds = self._seconds, 0.0
        return Collected(
            [t for t, _ in done], [c for _, c in done], *delta[:3], seconds,
            float(self.engine.cache.used), *delta[3:],
        )  # fmt: skip

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._partial)

    def _counters(self) -> list[int]:
        stats, batch = self.engine.stats, self.batch
        return [
            stats.prompt_tokens, stats.prefill_tokens, stats.generated_tokens,
            batch.steps, batch.row_steps,
        ]  # fmt: skip

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self.batch.pending:
                    self._running = False
                    return
                start = time.perf_counter()
                try:
                    answers = self.batch.step()
                except BaseException as err:  # handed to the next collect
                    self._error, self._running = err, False
                    self._cond.notify_all()
                    return
                self._seconds += time.perf_counter() - start
                for (turn, j), completion in answers:
                    samples = self._partial[turn]
                    samples[j] = completion
                    if all(s is not None for s in samples):
                        del self._partial[turn]
                        self._done.append((turn, [s for s in samples if s is not None]))
                if answers:
                    self._cond.notify_all()
