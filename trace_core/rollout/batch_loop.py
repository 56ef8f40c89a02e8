"""``BatchLoop``: an engine actor's running batch, stepped by a thread of its own, fed and
drained by calls (the actor side of the continuous driver, ``rollout.ray_continuous``).

    loop = BatchLoop(engine)                               # a TorchEngine or a VLLMEngine
    loop.submit([(turn_id, prompt, seed), ...], params)   # joins the running batch
    got = loop.collect(wait_s=1.0)                         # the turns answered since, at once

``submit`` returns at once: its turns wait for the next step boundary, where the batch admits
them while rows are free (a TorchEngine's ``policy.continuous``; vLLM's own scheduler through
``policy.vllm_batch``). The thread steps the batch while anything is
pending and sleeps otherwise. ``collect`` blocks until some turn has all its samples (or
``wait_s`` passes) and hands back every such turn with the engine's counters since the last
collect, so the driver handles completions as they arrive. A step that raises stops the loop;
the next ``collect`` raises it. The engine's other calls (a weight load, a whole ``generate``)
run inside ``idle()``, which holds the batch still and refuses while turns are in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from trace_core.policy.continuous import Request
from trace_core.policy.engine import Completion, Engine, SamplingParams
from trace_core.policy.sampling import request_keys
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.vllm_engine import VLLMEngine
from trace_core.rollout.worker_result import Collected

WAIT_S = 0.05
"""How long the loop's thread waits for a batch that answers by itself (vLLM's) before it
looks at the batch again."""


class RunningBatch(Protocol):
    """What a loop steps: ``continuous.ContinuousBatch``, ``replicas.ReplicaPool`` or
    ``vllm_batch.VLLMBatch``."""

    steps: int
    row_steps: int
    row_counts: Counter[int]

    @property
    def pending(self) -> int: ...

    def add(self, request: Request, tag: Hashable | Any = None) -> None: ...

    def wait(self, timeout: float) -> None:
        """Block, without the loop's lock, until ``step`` has something (vLLM's answers
        arrive by themselves); a batch that steps by computing returns at once."""

    def step(self) -> list[tuple[Any, Completion]]: ...


def running_batch(engine: Engine) -> RunningBatch:
    """The running batch of ``engine``: a TorchEngine's scheduler, or vLLM's."""
    if isinstance(engine, TorchEngine):
        return engine.running_batch()
    if isinstance(engine, VLLMEngine):
        from trace_core.policy.vllm_batch import VLLMBatch  # imports vllm

        return VLLMBatch(engine)
    raise ValueError(
        f"the continuous driver runs TorchEngine and vLLM actors; this one runs "
        f"{type(engine).__name__} (use driver async)"
    )


class BatchLoop:
    """An engine's running batch behind a lock, stepped by a daemon thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.batch = running_batch(engine)
        self._cond = threading.Condition()
        self._done: list[tuple[int, list[Completion]]] = []
        self._partial: dict[int, list[Completion | None]] = {}
        self._error: BaseException | None = None
        self._running = False  # a thread steps the batch (set and cleared under the lock)
        self._seconds = 0.0
        self._marks = self._counters()
        self._counts = Counter(self.batch.row_counts)

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
            counts, self._counts = (
                self.batch.row_counts - self._counts,
                Counter(self.batch.row_counts),
            )
        return Collected(
            [c for _, c in done], *delta[:3], seconds, self._cache_used(), *delta[3:],
            dict(counts), ids=[t for t, _ in done],
        )  # fmt: skip

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._partial)

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Hold the batch still while the engine does something else (new weights, a whole
        ``generate``); refused while turns are in flight: weights change between rollouts."""
        with self._cond:
            if self._partial:
                raise RuntimeError(
                    f"{len(self._partial)} turns are in flight in this engine's running batch; "
                    "it takes new weights or other calls once they are answered"
                )
            yield

    def _cache_used(self) -> float:
        used = getattr(self.engine, "cache_used", 0)  # a TorchEngine's prefix cache
        return float(used)

    def _counters(self) -> list[int]:
        stats, batch = self.engine.stats, self.batch
        return [
            stats.prompt_tokens, stats.prefill_tokens, stats.generated_tokens,
            batch.steps, batch.row_steps,
        ]  # fmt: skip

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            self.batch.wait(WAIT_S)  # without the lock: submits go on meanwhile
            with self._cond:
                if not self.batch.pending:
                    self._running = False
                    return
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
