"""``TorchEngine``: batched sampling with a radix prefix cache, on CPU or CUDA, in plain torch.

Built for tree rollouts, where most of what a call is asked to read was already read: the
``n`` samples of a prompt share it, the next turn of a rollout is the previous prompt plus
its sampled turn plus a short observation, and TRACE branches from the middle of earlier
turns. The engine stores keys and values once per distinct token prefix and runs the model
only over tokens it has never seen.

**Prefix cache.** A radix tree over token ids (as SGLang's RadixAttention). Each node holds a
run of tokens and the *slots* of their keys and values in one preallocated pool
(``cache_tokens`` slots of ``(layers, kv_heads, head_dim)``). A node's KV depends only on the
path from the root, so any prompt that walks through a node reuses it. Generated tokens are
inserted too, so the next turn of a rollout runs only its observation tokens. Nodes on the
paths of the current call are locked; when the pool is full, unlocked leaves are evicted,
least recently used first.

**A call.**

1. *Prefill.* Every distinct prompt is inserted into the tree; the tokens no node holds yet
   become *pending* nodes, which also merges prompts that share an uncached prefix. Pending
   nodes are computed in waves (a node is ready once its parent has KV), each wave one batched
   forward pass: the rows' cached context is gathered from the pool, the new tokens run at
   their positions, and their KV is written back to fresh slots. A prompt must produce logits
   for its last token, so a prompt that is already fully cached reruns just that token.
2. *Decode.* The ``n`` samples of each prompt become rows of a dense per-call KV buffer
   (column = position, see ``qwen3``), filled from the pool by one gather: a prompt is
   prefilled once however many samples it has. Each step runs one token per row through
   ``qwen3.forward``, samples from the logits with a ``torch.Generator`` seeded from
   ``seed``, and checks the stop tokens; a step does no per-row Python work. Rows of
   different lengths share the batch: each writes at its own position and attends to its
   own columns only. The token sampled last is run too, so its KV exists for the next turn.
3. *Retire.* Finished rows are inserted into the tree (their generated KV copied to the
   pool) and, once a quarter of the batch has finished, dropped from it.

**Sampling.** Temperature, then top-p (the smallest set of most likely tokens whose mass
reaches ``top_p``), then inverse-CDF sampling with one uniform draw per row; temperature 0 is
greedy. Logprobs are ``log_softmax`` of the raw logits (temperature 1, no top-p) at the
sampled token, as the ``Completion`` contract says. The same call with the same seed on an
engine in the same state gives the same tokens; KV from the cache and KV computed afresh
agree to float rounding only, so a sample sitting on a tie could still flip.

Not validated yet: CUDA (written device-agnostic, exercised on CPU only), bfloat16 weights,
and a pool that cannot hold one call's prompts (refused with an error, not spilled).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from trace_core.policy import qwen3
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.qwen3 import KVCache, Qwen3Weights


class _Node:
    """A run of tokens in the radix tree; ``slots`` is None while the node is pending."""

    __slots__ = ("children", "last_used", "parent", "refs", "slots", "tokens")

    def __init__(
        self, tokens: tuple[int, ...], slots: torch.Tensor | None, parent: _Node | None
    ) -> None:
        self.tokens = tokens
        self.slots = slots  # (len(tokens),) pool indices on the pool's device; None: pending
        self.parent = parent
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.refs = 0  # calls in flight that need this node (locked when > 0)
        self.last_used = 0

    def ancestry(self) -> list[_Node]:
        """The path from the root (excluded) down to this node (included)."""
        path, node = [], self
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]


class PrefixCache:
    """Radix tree over token ids whose nodes own slots of a preallocated KV pool.

    The pool holds ``capacity`` tokens; slot ``i`` is ``k[:, i]`` and ``v[:, i]``, each
    ``(layers, kv_heads, head_dim)``. Paths are found by walking tokens, never kept across
    inserts: an insert may split a node, and the old node object then holds only its tail.
    """

    def __init__(self, weights: Qwen3Weights, capacity: int) -> None:
        s = weights.spec
        shape = (s.num_layers, capacity, s.num_kv_heads, s.head_dim)
        self.k = torch.zeros(shape, device=weights.device, dtype=weights.dtype)  # (L, S, Hkv, D)
        self.v = torch.zeros(shape, device=weights.device, dtype=weights.dtype)
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self._empty = torch.empty(0, dtype=torch.long, device=self.k.device)
        self.root = _Node((), self._empty, None)
        self._free = torch.arange(self.capacity, device=self.k.device)
        self._clock = itertools.count(1)
        self.evicted_tokens = 0

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    # -- structure ---------------------------------------------------------------------------

    def insert(self, tokens: tuple[int, ...]) -> list[_Node]:
        """The path of nodes spelling ``tokens``, ending exactly at ``len(tokens)``.

        Nodes are split where the path must end or branch; the tokens no node held become one
        new pending leaf (``slots`` None) that the caller fills or ``discard``s.
        """
        now = next(self._clock)
        node, i, path = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tokens[i:], None, node)
                node.children[tokens[i]] = child
            else:
                n = len(child.tokens)
                if tokens[i : i + n] != child.tokens:
                    n = _common_prefix(child.tokens, tokens, i)
                    child = self._split(child, n)
            child.last_used = now
            path.append(child)
            node, i = child, i + len(child.tokens)
        return path

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after ``n`` tokens and return the new upper part."""
        assert node.parent is not None and 0 < n < len(node.tokens)
        top = _Node(node.tokens[:n], None if node.slots is None else node.slots[:n], node.parent)
        top.refs, top.last_used = node.refs, node.last_used  # locks hold on both halves
        node.parent.children[node.tokens[0]] = top
        node.tokens = node.tokens[n:]
        node.slots = None if node.slots is None else node.slots[n:]
        node.parent = top
        top.children[node.tokens[0]] = node
        return top

    def walk(self, tokens: tuple[int, ...]) -> list[_Node]:
        """The existing path that ends exactly at ``len(tokens)`` (as ``insert`` left it)."""
        node, i, path = self.root, 0, []
        while i < len(tokens):
            node = node.children[tokens[i]]
            i += len(node.tokens)
            path.append(node)
        if i != len(tokens):
            raise KeyError("the path does not end at a node boundary")
        return path

    def acquire(self, tokens: tuple[int, ...]) -> None:
        now = next(self._clock)
        for node in self.walk(tokens):
            node.refs += 1
            node.last_used = now

    def release(self, tokens: tuple[int, ...]) -> None:
        for node in self.walk(tokens):
            node.refs -= 1

    def discard(self, nodes: Sequence[_Node]) -> None:
        """Remove nodes of a failed fill (deepest first), returning any slots they took."""
        for node in sorted(nodes, key=lambda x: -len(x.ancestry())):
            parent = node.parent
            if node.children or parent is None or parent.children.get(node.tokens[0]) is not node:
                continue
            del parent.children[node.tokens[0]]
            if node.slots is not None:
                self._free = torch.cat([self._free, node.slots])

    def slots_of(self, path: Sequence[_Node]) -> torch.Tensor:
        """The pool slots of a path's tokens, in order (c,)."""
        parts = [n.slots for n in path]
        if any(p is None for p in parts):
            raise RuntimeError("the path has pending nodes")
        return torch.cat([self._empty, *parts])  # type: ignore[list-item]

    # -- slots -------------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slots, evicting least recently used unlocked leaves; None if impossible."""
        if n > len(self._free):
            self._evict(n - len(self._free))
        if n > len(self._free):
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def _evict(self, need: int) -> None:
        def evictable(node: _Node) -> bool:
            return (
                node.parent is not None
                and not node.children
                and node.refs == 0
                and node.slots is not None
            )

        heap = [(n.last_used, id(n), n) for n in self._nodes() if evictable(n)]
        heapq.heapify(heap)
        freed = []
        while need > 0 and heap:
            _, _, node = heapq.heappop(heap)
            assert node.parent is not None and node.slots is not None
            del node.parent.children[node.tokens[0]]
            freed.append(node.slots)
            need -= len(node.tokens)
            self.evicted_tokens += len(node.tokens)
            if evictable(node.parent):
                heapq.heappush(heap, (node.parent.last_used, id(node.parent), node.parent))
        self._free = torch.cat([self._free, *freed])

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], offset: int) -> int:
    n = 0
    while n < len(a) and offset + n < len(b) and a[n] == b[offset + n]:
        n += 1
    return n


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) -> (B,); greedy when ``temperature`` is 0.

    Inverse-CDF sampling: one uniform per row against the cumulative probabilities, in
    float64 so that the rounding edge ``u · total == total`` (which would pick the last
    token whatever its probability) has odds near 2⁻⁵³. ``torch.multinomial`` draws an
    exponential per vocabulary entry instead: ten times slower for a 64 × 300 batch here.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, V)
    u = torch.rand(
        (logits.shape[0], 1), generator=generator, device=logits.device, dtype=torch.float64
    )
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # (B, 1)
    picked = picked.clamp_(max=logits.shape[-1] - 1)
    if order is not None:
        picked = order.gather(-1, picked)
    return picked.squeeze(-1)


@dataclass(frozen=True)
class _Row:
    """A prefill row: run ``tokens`` after ``context``, whose KV is already in the pool."""

    context: torch.Tensor  # (c,) pool slots
    tokens: tuple[int, ...]
    fills: _Node | None  # the node these tokens' KV goes to; None: a rerun for logits only
    logits_for: int | None  # the distinct prompt whose first-token logits this row yields


@dataclass
class _Batch:
    """The live rows of a decode: their KV buffer, last tokens and outputs so far."""

    kv: KVCache  # (L, B, Hkv, P + max_tokens, D)
    tok: torch.Tensor  # (B,) the token each row feeds next
    pos: torch.Tensor  # (B,) the position of each row's first generated token
    out_tok: torch.Tensor  # (B, max_tokens)
    out_lp: torch.Tensor  # (B, max_tokens)
    done: torch.Tensor  # (B,) sampled a stop token
    live: list[int]  # batch row -> index among the call's rows

    def keep(self, mask: torch.Tensor) -> None:
        self.kv = KVCache(self.kv.k[:, mask], self.kv.v[:, mask])
        self.tok, self.pos, self.done = self.tok[mask], self.pos[mask], self.done[mask]
        self.out_tok, self.out_lp = self.out_tok[mask], self.out_lp[mask]
        self.live = [i for i, k in zip(self.live, mask.tolist(), strict=True) if k]


class TorchEngine:
    """The ``Engine`` protocol over Qwen3 weights (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        device: str | torch.device = "cpu",
        max_batch: int = 256,
        cache_tokens: int = 65_536,
        prefill_chunk: int = 16_384,
    ) -> None:
        """``max_batch``: decode rows at once (more run in turn; each holds its prompt's KV
        and ``max_tokens`` more columns); ``cache_tokens``: slots in the prefix-cache pool;
        ``prefill_chunk``: token columns (rows × width) of one prefill pass's KV buffer."""
        if min(max_batch, cache_tokens, prefill_chunk) < 1:
            raise ValueError("max_batch, cache_tokens and prefill_chunk must be >= 1")
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.stats = EngineStats()
        self.weights = Qwen3Weights.from_model(model, self.device)
        self.cache = PrefixCache(self.weights, cache_tokens)

    def update_weights(self, model: PreTrainedModel) -> None:
        """Snapshot new weights (after a training step); the KV cached so far is dropped."""
        self.weights = Qwen3Weights.from_model(model, self.device)
        self.cache.clear()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        prompt_list = [tuple(int(t) for t in p) for p in prompts]
        self._check(prompt_list, params)
        if not prompt_list:
            return []
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)

        distinct = list(dict.fromkeys(prompt_list))  # identical prompts share one prefill
        index = {p: u for u, p in enumerate(distinct)}
        rows = [index[p] for p in prompt_list for _ in range(params.n)]
        out: list[Completion] = []
        with torch.inference_mode():
            first_logits, contexts = self._prefill(distinct)
            try:
                for lo in range(0, len(rows), self.max_batch):
                    batch = rows[lo : lo + self.max_batch]
                    out += self._decode(batch, distinct, contexts, first_logits, params, generator)
            finally:
                for p in distinct:
                    self.cache.release(p)

        self.stats.calls += 1
        self.stats.prompt_tokens += sum(len(p) for p in prompt_list)
        self.stats.generated_tokens += sum(len(c.token_ids) for c in out)
        self.stats.extra["cache_used_tokens"] = float(self.cache.used)
        self.stats.extra["evicted_tokens"] = float(self.cache.evicted_tokens)
        n = params.n
        return [out[i * n : (i + 1) * n] for i in range(len(prompt_list))]

    def _check(self, prompts: list[tuple[int, ...]], params: SamplingParams) -> None:
        spec = self.weights.spec
        for p in prompts:
            if not p:
                raise ValueError("every prompt needs at least one token")
            if min(p) < 0 or max(p) >= spec.vocab_size:
                raise ValueError(f"prompt token ids must be in [0, {spec.vocab_size})")
            if len(p) + params.max_tokens > spec.max_positions:
                raise ValueError(
                    f"a prompt of {len(p)} tokens + max_tokens={params.max_tokens} exceeds "
                    f"the model's {spec.max_positions} positions"
                )

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, distinct: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """First-token logits (U, V) and the KV slots (len,) of each distinct prompt.

        Leaves the prompts' paths locked (the caller releases them).
        """
        cache = self.cache
        for p in distinct:
            cache.insert(p)
        for p in distinct:  # only now: a later insert may split an earlier prompt's path
            cache.acquire(p)
        paths = [cache.walk(p) for p in distinct]
        created = list({n: None for path in paths for n in path if n.slots is None})
        ends = {path[-1]: u for u, path in enumerate(paths)}
        logits = torch.empty((len(distinct), self.weights.spec.vocab_size), device=self.device)
        try:
            # A fully cached prompt reruns its last token: its KV is stored, its logits not.
            rows = [
                _Row(cache.slots_of(path)[:-1], distinct[u][-1:], None, u)
                for u, path in enumerate(paths)
                if path[-1].slots is not None
            ]
            pending = created
            while pending:  # a wave: the pending nodes whose parent has its KV
                ready = [n for n in pending if n.parent is not None and n.parent.slots is not None]
                assert ready, "a pending node under a pending node that is not on any path"
                taken = set(ready)
                pending = [n for n in pending if n not in taken]
                slots = cache.alloc(sum(len(n.tokens) for n in ready))
                if slots is None:
                    raise RuntimeError(
                        f"the prefix cache ({cache.capacity} tokens) cannot hold this call's "
                        "prompts: raise cache_tokens or send fewer prompts per call"
                    )
                parts = slots.split([len(n.tokens) for n in ready])
                for node, part in zip(ready, parts, strict=True):
                    assert node.parent is not None
                    context = cache.slots_of(node.parent.ancestry())
                    rows.append(_Row(context, node.tokens, node, ends.get(node)))
                    node.slots = part  # filled by _run_rows before the next wave reads it
                self._run_rows(rows, logits)
                rows = []
            if rows:
                self._run_rows(rows, logits)
            return logits, [cache.slots_of(path) for path in paths]
        except BaseException:
            for p in distinct:
                cache.release(p)
            cache.discard(created)
            raise

    def _run_rows(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Run prefill rows in passes whose KV buffers hold ``prefill_chunk`` columns at most
        (rows × (longest context + longest new run); a single longer row runs alone)."""
        rows = sorted(rows, key=lambda r: -len(r.tokens))  # similar lengths pad little
        chunk: list[_Row] = []
        context = 0
        for row in rows:
            wider = max(context, len(row.context))
            if chunk and (len(chunk) + 1) * (wider + len(chunk[0].tokens)) > self.prefill_chunk:
                self._run_chunk(chunk, logits)
                chunk, wider = [], len(row.context)
            chunk.append(row)
            context = wider
        if chunk:
            self._run_chunk(chunk, logits)

    def _run_chunk(self, rows: list[_Row], logits: torch.Tensor) -> None:
        w, cache, dev = self.weights, self.cache, self.device
        R, S = len(rows), len(rows[0].tokens)
        ctx = [len(r.context) for r in rows]
        C = max(ctx)
        kv = KVCache.zeros(w, R, C + S)
        if C:
            table = _pad([r.context for r in rows], C, dev)  # (R, C)
            kv.k[:, :, :, :C] = cache.k[:, table].permute(0, 1, 3, 2, 4)  # (L, R, Hkv, C, D)
            kv.v[:, :, :, :C] = cache.v[:, table].permute(0, 1, 3, 2, 4)
        tokens = torch.zeros((R, S), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = torch.tensor(r.tokens)
        ctx_t = torch.tensor(ctx, device=dev)
        # Padding queries run at positions past their row's tokens: their writes land in
        # columns no real query of the row can see.
        positions = ctx_t[:, None] + torch.arange(S, device=dev)  # (R, S)
        hidden = qwen3.forward(w, tokens.to(dev), positions, kv, span=C + S)  # (R, S, C)
        self.stats.prefill_tokens += sum(len(r.tokens) for r in rows)

        fill = [(i, r) for i, r in enumerate(rows) if r.fills is not None]
        if fill:
            row_idx = torch.cat([torch.full((len(r.tokens),), i) for i, r in fill]).to(dev)
            cols = torch.cat([ctx[i] + torch.arange(len(r.tokens)) for i, r in fill]).to(dev)
            slots = torch.cat([r.fills.slots for _, r in fill])  # type: ignore[union-attr,misc]
            cache.k[:, slots] = kv.k[:, row_idx, :, cols].transpose(0, 1)  # (L, N, Hkv, D)
            cache.v[:, slots] = kv.v[:, row_idx, :, cols].transpose(0, 1)
        want = [(i, r.logits_for) for i, r in enumerate(rows) if r.logits_for is not None]
        if want:
            at = torch.tensor([i for i, _ in want], device=dev)
            last = torch.tensor([len(rows[i].tokens) - 1 for i, _ in want], device=dev)
            dest = torch.tensor([u for _, u in want], device=dev)
            logits[dest] = qwen3.lm_logits(w, hidden[at, last])

    # -- decode ------------------------------------------------------------------------------

    def _decode(
        self,
        rows: list[int],
        distinct: list[tuple[int, ...]],
        contexts: list[torch.Tensor],
        first_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> list[Completion]:
        """Sample one completion per row (each row names its distinct prompt)."""
        w, dev, max_new = self.weights, self.device, params.max_tokens
        prompts = [distinct[u] for u in rows]
        lens = [len(p) for p in prompts]
        B, P = len(rows), max(lens)
        kv = KVCache.zeros(w, B, P + max_new)
        table = _pad([contexts[u] for u in rows], P, dev)  # (B, P): samples share prompt KV
        kv.k[:, :, :, :P] = self.cache.k[:, table].permute(0, 1, 3, 2, 4)
        kv.v[:, :, :, :P] = self.cache.v[:, table].permute(0, 1, 3, 2, 4)
        tok, lp = self._sample(first_logits[torch.tensor(rows, device=dev)], params, generator)
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        batch = _Batch(
            kv=kv,
            tok=tok,
            pos=torch.tensor(lens, device=dev),
            out_tok=torch.zeros((B, max_new), dtype=torch.long, device=dev),
            out_lp=torch.zeros((B, max_new), dtype=torch.float32, device=dev),
            done=torch.isin(tok, stops),
            live=list(range(B)),
        )
        batch.out_tok[:, 0], batch.out_lp[:, 0] = tok, lp
        longest = P  # longest prompt among live rows: attention spans longest + t + 1 columns
        results: list[Completion | None] = [None] * B

        for t in range(max_new):
            positions = batch.pos[:, None] + t
            hidden = qwen3.forward(w, batch.tok[:, None], positions, batch.kv, longest + t + 1)
            # The token sampled last now has its KV too: a row that is done is complete.
            n_done = len(batch.live) if t == max_new - 1 else int(batch.done.sum())
            if n_done == len(batch.live):
                everyone = torch.ones_like(batch.done)
                self._retire(batch, everyone, t, prompts, params, results)
                break
            if 4 * n_done >= len(batch.live):  # drop the finished quarter: it costs a copy
                self._retire(batch, batch.done, t, prompts, params, results)
                hidden = hidden[~batch.done]
                batch.keep(~batch.done)
                longest = max(lens[i] for i in batch.live)
            tok, lp = self._sample(qwen3.lm_logits(w, hidden[:, -1]), params, generator)
            batch.tok = tok
            batch.out_tok[:, t + 1], batch.out_lp[:, t + 1] = tok, lp
            batch.done |= torch.isin(tok, stops)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B,) and their log-probabilities at temperature 1 (B,)."""
        tok = sample_tokens(logits, params.temperature, params.top_p, generator)
        lp = logits.log_softmax(dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, lp

    def _retire(
        self,
        batch: _Batch,
        which: torch.Tensor,
        t: int,
        prompts: list[tuple[int, ...]],
        params: SamplingParams,
        results: list[Completion | None],
    ) -> None:
        """Turn the rows in ``which`` (B,) into completions after step ``t``, and cache them."""
        sel = which.nonzero().squeeze(1)
        toks = batch.out_tok[sel, : t + 1].cpu().numpy()
        lps = batch.out_lp[sel, : t + 1].cpu().numpy()
        is_stop = np.isin(toks, np.asarray(params.stop_token_ids, dtype=toks.dtype))
        finished = np.asarray(is_stop.any(axis=1))
        length = np.where(finished, is_stop.argmax(axis=1) + 1, t + 1)  # up to the first stop
        seqs = []
        for j, b in enumerate(sel.tolist()):
            n, row = int(length[j]), batch.live[b]
            results[row] = Completion(
                token_ids=toks[j, :n].astype(np.int32),
                logprobs=lps[j, :n].astype(np.float32),
                finished=bool(finished[j]),
            )
            seqs.append((b, prompts[row] + tuple(toks[j, :n].tolist())))
        self._cache_generated(seqs, batch.kv)

    def _cache_generated(self, seqs: list[tuple[int, tuple[int, ...]]], kv: KVCache) -> None:
        """Insert (batch row, prompt + completion) into the tree, copying the new KV to the pool.

        Best effort: when the pool has no room, the completions are simply not cached.
        """
        cache, dev = self.cache, self.device
        source: dict[_Node, int] = {}  # pending node -> a batch row that holds its tokens
        for b, seq in seqs:
            for node in cache.insert(seq):
                if node.slots is None:
                    source.setdefault(node, b)
        if not source:
            return
        nodes = list(source)
        slots = cache.alloc(sum(len(n.tokens) for n in nodes))
        if slots is None:
            cache.discard(nodes)
            return
        row_idx, cols = [], []
        for node, part in zip(nodes, slots.split([len(n.tokens) for n in nodes]), strict=True):
            start = sum(len(a.tokens) for a in node.ancestry()) - len(node.tokens)
            row_idx.append(torch.full((len(node.tokens),), source[node]))
            cols.append(torch.arange(start, start + len(node.tokens)))  # column = position
            node.slots = part
        r, c = torch.cat(row_idx).to(dev), torch.cat(cols).to(dev)
        cache.k[:, slots] = kv.k[:, r, :, c].transpose(0, 1)  # (L, N, Hkv, D)
        cache.v[:, slots] = kv.v[:, r, :, c].transpose(0, 1)


def _pad(slot_lists: Sequence[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """Stack slot vectors into (N, width), padding with slot 0 (masked or overwritten later)."""
    table = torch.zeros((len(slot_lists), width), dtype=torch.long, device=device)
    for i, s in enumerate(slot_lists):
        table[i, : len(s)] = s
    return table
