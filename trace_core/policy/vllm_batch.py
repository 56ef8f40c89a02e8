"""``VLLMBatch``: a ``VLLMEngine``'s running batch, fed request by request, behind the interface
of ``policy.continuous.ContinuousBatch`` (``add``, ``wait``, ``step``, ``pending``), so that an
engine actor's ``rollout.batch_loop`` drives either engine.

    batch = VLLMBatch(vllm_engine)
    batch.add(Request(prompt, params, key), tag)   # one vLLM request, in vLLM at once
    while batch.pending:
        batch.wait(0.05)                           # until some request has finished
        for tag, completion in batch.step():       # every request finished since
            ...

vLLM's ``AsyncLLM`` schedules continuously already: its engine core admits waiting requests at
every step up to ``max_num_seqs`` and its KV blocks, and keeps stepping while requests run. So
``add`` starts the request's ``AsyncLLM.generate`` on the engine's event loop straight away (a
turn joins the running batch at vLLM's next step, whatever else is in flight), and its answer
lands in a queue when it finishes; ``step`` only hands over what has landed. Stepping is vLLM's:
this batch's ``steps``, ``row_steps`` and ``row_counts`` are the ones vLLM's stat logger counts
into the engine (``vllm_engine.step_rows``).

A request samples with seed ``key >> 32``, as ``VLLMEngine.generate`` seeds it, so the two
sample alike.
"""

from __future__ import annotations

import queue
from collections import Counter
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any

from trace_core.policy.continuous import Request
from trace_core.policy.engine import Completion
from trace_core.policy.vllm_engine import VLLMEngine, vllm_sampling

UPSTREAM = ("vllm.TokensPrompt(prompt_token_ids)",)
"""What this module calls in vLLM (``policy.upstream``: entry syntax there; the sampling
parameters are ``policy.vllm_engine``'s)."""


class VLLMBatch:
    """Requests in flight in ``engine``'s vLLM engine; ``tag``: handed back with the answer."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self._landed: queue.SimpleQueue[Future[tuple[Any, Completion]]] = queue.SimpleQueue()
        self._ready: list[Future[tuple[Any, Completion]]] = []  # taken off the queue by wait
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def steps(self) -> int:
        return int(self.engine.stats.extra.get("decode_steps", 0))

    @property
    def row_steps(self) -> int:
        return int(self.engine.stats.extra.get("decode_row_steps", 0))

    @property
    def row_counts(self) -> Counter[int]:
        return self.engine.row_counts

    def add(self, request: Request, tag: Hashable | Any = None) -> None:
        vllm = self.engine._vllm
        params = vllm_sampling(request.params, request.key >> 32)
        prompt = vllm.TokensPrompt(prompt_token_ids=list(request.prompt))
        done = self.engine.submit(self._answer(prompt, params, request, tag))
        done.add_done_callback(self._landed.put)
        self._pending += 1

    async def _answer(
        self, prompt: Any, params: Any, request: Request, tag: Any
    ) -> tuple[Any, Completion]:
        out = await self.engine.final_output(prompt, params)
        return tag, self.engine.answered(out, request.params.stop_token_ids)

    def wait(self, timeout: float) -> None:
        """Block until some request has finished (or ``timeout`` passes)."""
        if self._pending and not self._ready:
            try:
                self._ready.append(self._landed.get(timeout=timeout))
            except queue.Empty:
                return

    def step(self) -> list[tuple[Any, Completion]]:
        """Every request that finished since the last call, answered; a request that failed
        raises its error here."""
        ready, self._ready = self._ready, []
        while True:
            try:
                ready.append(self._landed.get_nowait())
            except queue.Empty:
                break
        self._pending -= len(ready)
        return [done.result() for done in ready]
