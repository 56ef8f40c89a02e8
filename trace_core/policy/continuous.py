"""``ContinuousBatch``: one ``TorchEngine``'s running decode batch, which requests join at any
step boundary and leave the step they finish (continuous batching, as vLLM schedules).

    batch = ContinuousBatch(engine)
    batch.add(Request(prompt, params, key), tag)     # waits for a free row
    while batch.pending:
        for tag, completion in batch.step():          # the requests that finished this step
            ...                                        # ... and add() the next turns at once

A request is one sample: ``prompt`` continued with ``params`` (its ``n`` is ignored), drawing
with ``key`` (``sampling.KeyedDraws``: its tokens do not depend on what else is in the batch;
the batch computes each request's uniforms once, when it joins: ``sampling.keyed_table``).

**A step.** Every row runs one token through ``decode.decode_step``; the rows whose last
sampled token is now in the KV (a stop token, or their ``max_tokens``) are answered and their
sequences go into the prefix cache; every other row samples its next token. Then, at the step
boundary, waiting requests are admitted while rows are free (``max_batch``; once an eighth of
them are, ``ADMIT_EVERY``): their distinct
prompts are prefilled through the prefix cache in one go (``TorchEngine._prefill``: only
tokens no node holds run), each samples its first token, and they join the batch. The batch's
KV buffer (row = request, column = position) is laid out again only when rows join or once a
quarter of them has finished (finished rows idle until then: a re-layout copies the batch's
KV, about one step's reads). Requests whose sampling differs from the running batch's
(temperature, top-p, stop tokens) wait until it drains; ``max_tokens`` may differ per row.

Admission keeps each admitted group's prompts within half the prefix-cache pool, as
``TorchEngine`` always has; a prompt's KV is copied into the batch when it joins, so nothing
stays locked in the pool while rows decode.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from trace_core.policy import decode, decoder
from trace_core.policy.decoder import DecoderWeights, KVCache
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.prefix_cache import PrefixCache
from trace_core.policy.sampling import TableDraws, keyed_table, sample


class Engine(Protocol):
    """What a batch uses of its ``TorchEngine``: weights, prefix cache, prefill and caching."""

    device: torch.device
    weights: DecoderWeights
    cache: PrefixCache
    stats: EngineStats
    max_batch: int

    def _check(self, prompts: list[tuple[int, ...]], params: SamplingParams) -> None: ...

    def _prefill(
        self, distinct: list[tuple[int, ...]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def _gather_context(self, slot_lists: list[torch.Tensor], width: int, kv: KVCache) -> None: ...

    def _cache_generated(self, seqs: list[tuple[int, tuple[int, ...]]], kv: KVCache) -> None: ...


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: SamplingParams
    key: int
    """Its sampling key (``sampling.request_keys``)."""


def _sampling(params: SamplingParams) -> tuple[float, float, tuple[int, ...]]:
    """What the rows of one batch must share."""
    return params.temperature, params.top_p, tuple(params.stop_token_ids)


ADMIT_EVERY = 8
"""A running batch admits once 1/ADMIT_EVERY of its rows are free (or none run): each
admission lays the KV out again, a copy of the batch's KV that one row a step would repeat
every step. So while requests wait, at least 7/8 of ``max_batch`` rows run."""


class ContinuousBatch:
    """The running batch of ``engine`` (see the module docstring); ``tag``: any value, handed
    back with the request's completion."""

    def __init__(self, engine: Engine, storage: list[torch.Tensor] | None = None) -> None:
        """``storage``: two tensors the batch's KV buffers take turns over (grown as needed,
        in place), kept by the caller so that calls one after another reuse them: fresh
        zeroed memory for each call's buffer cost ≈1 % of a 64 × 64-token call."""
        self.engine = engine
        self.waiting: deque[tuple[Request, Any]] = deque()
        self._rows: list[tuple[Request, Any]] = []  # batch row -> its request
        self._finished: list[bool] = []  # answered, waiting for the next re-layout
        self._sampling: tuple[float, float, tuple[int, ...]] | None = None
        self._storage = storage if storage is not None else [torch.zeros(0), torch.zeros(0)]
        self.steps = 0  # decode steps run
        self.row_steps = 0  # rows summed over those steps (rows in flight x steps)
        self.row_counts: Counter[int] = Counter()  # rows in flight -> steps run with them

    @property
    def pending(self) -> int:
        """Requests added and not answered yet."""
        return len(self.waiting) + self._finished.count(False)

    @property
    def running(self) -> int:
        return self._finished.count(False)

    def add(self, request: Request, tag: Hashable | Any = None) -> None:
        self.engine._check([request.prompt], request.params)
        self.waiting.append((request, tag))

    def wait(self, timeout: float) -> None:
        """Nothing to wait for: ``step`` computes the next step itself."""

    def step(self) -> list[tuple[Any, Completion]]:
        """Admit what fits, run one decode step, answer the requests that finished."""
        with torch.inference_mode():
            if not self.running:
                self._relayout(self._admissions())
                if not self._rows:
                    return []
            done = self._decode()
            free = self.engine.max_batch - self.running
            admitted = self._admissions() if free >= self.engine.max_batch // ADMIT_EVERY else []
            if admitted or 4 * self._finished.count(True) >= max(len(self._rows), 1):
                self._relayout(admitted)
        return done

    # -- admission ---------------------------------------------------------------------------

    def _admissions(self) -> list[tuple[Request, Any]]:
        """The waiting requests that join at this boundary: FIFO, while rows are free, with
        the running batch's sampling, their prompts within half the cache pool."""
        free = self.engine.max_batch - self.running
        budget, used, seen = max(1, self.engine.cache.capacity // 2), 0, set()
        sampling = self._sampling if self.running else None
        out: list[tuple[Request, Any]] = []
        while self.waiting and len(out) < free:
            request, tag = self.waiting[0]
            if sampling is None:
                sampling = _sampling(request.params)
            if _sampling(request.params) != sampling:
                break
            cost = 0 if request.prompt in seen else len(request.prompt)
            if out and used + cost > budget:
                break
            self.waiting.popleft()
            out.append((request, tag))
            used, _ = used + cost, seen.add(request.prompt)
        if out:
            self._sampling = sampling
        return out

    # -- the batch's layout ------------------------------------------------------------------

    def _relayout(self, admitted: list[tuple[Request, Any]]) -> None:
        """A new KV buffer holding the running rows, then the admitted ones (their prompts
        prefilled and gathered, their first tokens sampled)."""
        engine, dev = self.engine, self.engine.device
        heads = engine.weights.spec.num_kv_heads
        keep = [i for i, f in enumerate(self._finished) if not f]
        rows = [self._rows[i] for i in keep] + admitted
        self._rows, self._finished = rows, [False] * len(rows)
        if not rows:
            return
        old = len(keep)
        length = max(len(r.prompt) + r.params.max_tokens for r, _ in rows)
        width = max(r.params.max_tokens for r, _ in rows)
        kv = self._buffer(len(rows), length)
        mask = torch.full((len(rows), length), float("-inf"), dtype=engine.weights.dtype)
        mask = mask.to(dev)
        out_tok = torch.zeros((len(rows), width), dtype=torch.long, device=dev)
        out_lp = torch.zeros((len(rows), width), dtype=torch.float32, device=dev)
        table = torch.zeros((len(rows), width), dtype=torch.float64, device=dev)
        state: list[torch.Tensor] = []  # tok, at, steps, done, keys, limits
        if old:
            index = torch.tensor(keep, device=dev)
            span = min(self._span, self._length, length)  # the columns written so far
            kv.kv[:, :, :old, :, :span] = self._kv.kv[:, :, index, :, :span]
            mask[:old, :span] = self._mask.view(-1, heads, self._length)[index, 0, :span]
            w = min(self._out_tok.shape[1], width)
            out_tok[:old, :w], out_lp[:old, :w] = self._out_tok[index, :w], self._out_lp[index, :w]
            table[:old, :w] = self._table[index, :w]  # a kept row's steps stay below its w
            state = [t[index] for t in self._state()]
        if admitted:
            new, logprobs = self._admit(admitted, kv, mask, old, table[old:])
            out_tok[old:, 0], out_lp[old:, 0] = new[0], logprobs
            state = [torch.cat((a, b)) for a, b in zip(state, new, strict=True)] if old else new
        self._tok, self._at, self._steps, self._done, self._keys, self._limits = state
        self._kv, self._length, self._out_tok, self._out_lp = kv, length, out_tok, out_lp
        self._views = decode.DecodeViews.of(kv)
        self._table = table
        stops = rows[0][0].params.stop_token_ids  # the batch's sampling: every row's
        self._stops = torch.tensor(stops, dtype=torch.long, device=dev) if stops else None
        self._mask = mask.repeat_interleave(heads, dim=0).unsqueeze(1)
        self._dest = decoder.kv_rows(self._at, len(rows), heads, length).flatten()
        self._live = torch.ones(len(rows), dtype=torch.bool, device=dev)
        # Steps each row has left before its max_tokens, kept on the host: without stop tokens
        # a step finds the rows that end without reading the device.
        self._left = (self._limits - self._steps).cpu().numpy()
        self._span = int(self._at.max()) + 1  # columns a step reads: grows by one a step

    def _state(self) -> list[torch.Tensor]:
        return [self._tok, self._at, self._steps, self._done, self._keys, self._limits]

    def _admit(
        self,
        admitted: list[tuple[Request, Any]],
        kv: KVCache,
        mask: torch.Tensor,
        first: int,
        table: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Prefill the admitted requests' prompts into rows ``first``.. of ``kv``, fill their
        rows of the uniforms ``table`` and sample their first tokens: their (tok, at, steps,
        done, keys, limits), and the first tokens' logprobs."""
        engine, dev = self.engine, self.engine.device
        prompts = [r.prompt for r, _ in admitted]
        distinct = list(dict.fromkeys(prompts))
        index = {p: u for u, p in enumerate(distinct)}
        rows = [index[p] for p in prompts]
        lens = [len(p) for p in prompts]
        logits, contexts = engine._prefill(distinct)
        try:
            view = KVCache(kv.kv[:, :, first:])
            engine._gather_context([contexts[u] for u in rows], max(lens), view)
        finally:
            for p in distinct:  # the rows hold their prompts' KV now
                engine.cache.release(p)
        at = torch.tensor(lens, device=dev)
        cols = torch.arange(mask.shape[1], device=dev)
        mask[first:] = mask[first:].masked_fill(cols < at[:, None], 0.0)
        keys = torch.tensor([r.key for r, _ in admitted], device=dev)
        table.copy_(keyed_table(keys, table.shape[1]))
        params = admitted[0][0].params
        first_logits = logits[torch.tensor(rows, device=dev)]
        zero = torch.zeros(len(admitted), dtype=torch.long, device=dev)
        picked = sample(first_logits, params.temperature, params.top_p, TableDraws(table, zero))
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        limits = torch.tensor([r.params.max_tokens for r, _ in admitted], device=dev)
        steps = torch.ones(len(admitted), dtype=torch.long, device=dev)
        done = torch.isin(picked.tokens, stops)
        return [picked.tokens, at, steps, done, keys, limits], picked.logprobs

    def _buffer(self, rows: int, length: int) -> KVCache:
        """A (L, 2, rows, Hkv, length, D) buffer over the spare storage (grown as needed,
        zeroed when made: stale values stay finite, hidden by the masks)."""
        s = self.engine.weights.spec
        shape = (s.num_layers, 2, rows, s.num_kv_heads, length, s.head_dim)
        n = int(np.prod(shape))
        spare = self._storage[1]
        if spare.numel() < n or spare.dtype != self.engine.weights.dtype:
            spare = torch.zeros(n, dtype=self.engine.weights.dtype, device=self.engine.device)
        # This one is in use; the old one is the spare (in place: the caller's list too).
        self._storage[:] = [spare, self._storage[0]]
        return KVCache(spare[:n].view(shape))

    # -- decode ------------------------------------------------------------------------------

    def _decode(self) -> list[tuple[Any, Completion]]:
        """One step: every row runs its last token; finished rows are answered; the others
        sample their next. Rows answered earlier idle in place (their position frozen)."""
        w = self.engine.weights
        rope = F.embedding(self._at, w.rope)
        span = min(self._length, self._span)
        hidden = decode.decode_step(w, self._tok, self._dest, rope, self._views, self._mask, span)
        self._span += 1
        self.steps += 1
        self.row_steps += self.running
        self.row_counts[self.running] += 1
        if self.running == len(self._rows):  # every row moves on
            self._at += 1
            self._dest += 1
        else:
            moved = self._live.long()
            self._at += moved
            self._dest.view(2, len(self._rows), -1).add_(moved[None, :, None])
        # The token sampled last now has its KV too: a row that stopped is complete.
        if self._stops is None:  # only max_tokens ends a row: known on the host
            over = [int(b) for b in np.flatnonzero(self._left <= 0) if not self._finished[b]]
            answers = []
            if over:
                ended = torch.zeros(len(self._rows), dtype=torch.bool, device=self._at.device)
                ended[torch.tensor(over, device=ended.device)] = True
                answers = self._retire(ended)
        else:
            ended = self._live & (self._done | (self._steps >= self._limits))
            answers = self._retire(ended) if bool(ended.any()) else []
        params = self._rows[0][0].params  # the batch's sampling (max_tokens aside)
        draws = decode.Draws(
            self._table, self._steps, self._out_tok, self._out_lp, params.temperature, params.top_p
        )
        self._tok = decode.sample_step(w, hidden, draws)
        self._left -= 1
        if self._stops is not None:
            self._done |= torch.isin(self._tok, self._stops)
        return answers

    def _retire(self, ended: torch.Tensor) -> list[tuple[Any, Completion]]:
        """Answer the rows in ``ended`` and put their sequences into the prefix cache."""
        engine = self.engine
        sel = ended.nonzero().squeeze(1)
        steps = self._steps[sel].tolist()
        toks = self._out_tok[sel].cpu().numpy()
        lps = self._out_lp[sel].cpu().numpy()
        answers, seqs = [], []
        for j, b in enumerate(sel.tolist()):
            request, tag = self._rows[b]
            row = toks[j, : steps[j]]
            hit = np.flatnonzero(np.isin(row, np.asarray(request.params.stop_token_ids)))
            n = int(hit[0]) + 1 if len(hit) else steps[j]
            completion = Completion(
                row[:n].astype(np.int32), lps[j, :n].astype(np.float32), bool(len(hit))
            )
            answers.append((tag, completion))
            seqs.append((b, request.prompt + tuple(int(t) for t in row[:n])))
            self._finished[b] = True
        # Idle from now on, a row writes each step where its last token is (never past the
        # buffer's end), which no one reads again.
        self._live &= ~ended
        self._at -= ended.long()
        self._dest.view(2, len(self._rows), -1).sub_(ended.long()[None, :, None])
        engine._cache_generated(seqs, self._kv)
        engine.stats.generated_tokens += sum(len(c.token_ids) for _, c in answers)
        return answers
