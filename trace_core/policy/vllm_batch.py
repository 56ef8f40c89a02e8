"""``VLLMBatch``: a ``VLLMEngine``'s own running batch, fed request by request, behind the
interface of ``policy.continuous.ContinuousBatch`` (``add``, ``step``, ``pending``), so that
an engine actor's ``rollout.batch_loop`` drives either engine.

    batch = VLLMBatch(vllm_engine)
    batch.add(Request(prompt, params, key), tag)   # one vLLM request, admitted by vLLM's
    while batch.pending:                           # scheduler at its next step
        for tag, completion in batch.step():       # the requests that finished
            ...

vLLM's v1 engine (``LLMEngine``, the one ``vllm.LLM`` holds) schedules continuously already:
its engine core, a process of its own, admits waiting requests at every step up to
``max_num_seqs`` and its KV blocks, and keeps stepping while requests run. ``add`` hands it a
request (``LLMEngine.add_request``) and ``step`` takes the outputs of its next step
(``LLMEngine.step``), so a turn joins the running batch the step after it is added, with no
call boundary in between. This is the engine that vLLM's ``AsyncLLM`` wraps for asyncio
callers; an engine actor steps it from a thread of its own instead (``BatchLoop``).

Each request asks for its new tokens only (``RequestOutputKind.DELTA``): a step's outputs are
the rows that ran in it, and their count is the step's rows in flight. A request samples with
seed ``key >> 32``, as ``VLLMEngine.generate`` seeds it, so the two sample alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any

from trace_core.policy.continuous import Request
from trace_core.policy.engine import Completion
from trace_core.policy.vllm_engine import VLLMEngine, completion_of, vllm_sampling

UPSTREAM = (
    "vllm.v1.engine.llm_engine.LLMEngine.add_request",
    "vllm.v1.engine.llm_engine.LLMEngine.step",
    "vllm.sampling_params.RequestOutputKind.DELTA",
)
"""What this module calls in vLLM (``policy.upstream`` checks each in the installed release)."""


class VLLMBatch:
    """Requests in flight in ``engine``'s vLLM engine; ``tag``: handed back with the answer."""

    def __init__(self, engine: VLLMEngine) -> None:
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self._llm_engine = engine._llm.llm_engine
        self._delta = RequestOutputKind.DELTA
        self._open: dict[str, tuple[Request, Any, list[int], list[float]]] = {}
        self._next = 0
        self.steps = 0  # vLLM steps that ran rows
        self.row_steps = 0  # rows summed over those steps
        self.row_counts: Counter[int] = Counter()  # rows in flight -> steps run with them

    @property
    def pending(self) -> int:
        return len(self._open)

    def add(self, request: Request, tag: Hashable | Any = None) -> None:
        vllm = self.engine._vllm
        params = vllm_sampling(request.params, request.key >> 32, output_kind=self._delta)
        rid = f"turn-{self._next}"
        self._next += 1
        prompt = vllm.TokensPrompt(prompt_token_ids=list(request.prompt))
        self._llm_engine.add_request(rid, prompt, params)
        self._open[rid] = (request, tag, [], [])
        self.engine.stats.prompt_tokens += len(request.prompt)

    def step(self) -> list[tuple[Any, Completion]]:
        """One vLLM step's outputs: the requests that finished in it, answered."""
        outputs = self._llm_engine.step()
        if outputs:
            self.steps += 1
            self.row_steps += len(outputs)
            self.row_counts[len(outputs)] += 1
        answers = []
        stats = self.engine.stats
        for out in outputs:
            request, tag, tokens, logprobs = self._open[out.request_id]
            if not tokens and out.num_cached_tokens is not None:  # the request's first step
                stats.prefill_tokens += len(request.prompt) - out.num_cached_tokens
            sample = out.outputs[0]
            new = [int(t) for t in sample.token_ids]
            tokens += new
            logprobs += [
                step[t].logprob for step, t in zip(sample.logprobs or [], new, strict=True)
            ]
            if len(logprobs) != len(tokens):
                raise RuntimeError("vLLM returned no per-token logprobs; was logprobs=0 passed?")
            if out.finished:
                del self._open[out.request_id]
                stops = request.params.stop_token_ids
                stats.generated_tokens += len(tokens)
                answers.append((tag, completion_of(tokens, logprobs, sample, stops)))
        return answers
