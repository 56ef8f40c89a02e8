"""``TorchEngine``: batched sampling with a radix prefix cache, on CPU or CUDA, in plain torch.

Built for tree rollouts, where most of what a call is asked to read was already read: the
``n`` samples of a prompt share it, the next turn of a rollout is the previous prompt plus
its sampled turn plus a short observation, and TRACE branches from the middle of earlier
turns. The engine stores keys and values once per distinct token prefix and runs the model
only over tokens it has never seen.

**Prefix cache.** A radix tree over token ids whose nodes own slots of one preallocated KV pool
(``prefix_cache``). Generated tokens are inserted too, so the next turn of a rollout runs only
its observation tokens.

**A call.**

1. *Prefill.* Every distinct prompt is inserted into the tree; the tokens no node holds yet
   become *pending* nodes, which also merges prompts that share an uncached prefix. Pending
   nodes are computed in waves (a node is ready once its parent has KV), each wave in batched
   ``decoder.forward`` passes of at most ``PASS_TOKENS`` token slots: the rows' cached context
   is gathered from the pool, the new tokens run at their positions, and their KV is written
   back to fresh slots. A prompt must produce logits for its last token, so a prompt that is
   already fully cached reruns just that token.
2. *Decode.* Every sample is a request of the engine's continuous batch
   (``policy.continuous``): rows of a dense KV buffer (column = position), filled from the pool
   by one gather when they join, so a prompt is prefilled once however many samples it has.
   Each step runs one token per row through ``decode.decode_step``, samples from the logits
   (each row with its own keyed uniforms, ``sampling.KeyedDraws``), and checks the stop
   tokens. Each row's write position, KV destination and additive attention mask are kept
   across steps and advanced in place. Rows of different lengths share the batch: each writes
   at its own position and attends to its own columns only. The token sampled last is run
   too, so its KV exists for the next turn.
3. *Retire and admit.* A finished row is answered at once and its sequence inserted into the
   tree (its generated KV copied to the pool); waiting requests join at the next step boundary
   while rows are free (``max_batch``), and the buffer is laid out again when rows join or a
   quarter has finished.

The prefill buffers live in storage kept across calls (see ``_kv_buffer``): zeroing fresh
memory for each call cost about a decode step's time.

**Sampling.** Temperature, then top-p, then one uniform draw per row (``sampling``); temperature
0 is greedy. Logprobs are ``log_softmax`` of the raw logits (temperature 1, no top-p) at the
sampled token, as the ``Completion`` contract says. Each sample draws from its own key
(``sampling.request_keys``: the request's seed and the sample's index), so its tokens do not
depend on the other prompts of the call, their order or how the call was split; an int
``seed`` seeds prompt ``i`` with ``request_seed(seed, i)``. KV from the cache and KV computed
afresh, and rows of batches of other sizes, agree to float rounding only, so a sample sitting
on a tie could still flip.

**Speed** (``trace-rl bench engine --repeats 9 --threads 2``: tiny policy, 64 prompts × 64 new
tokens, float32, this 2-core CPU, nine paired rounds): ≈2.5–3.0× HF ``generate`` on two
replicas (below) with the compiled step (``decode.decode_step``: the same operations from
C++, ``policy.native``), ≈1.1–1.3× the same engine decoding in Python; HF's own time moves by
a third between runs here (docs/engines.md). At batch 64 a step reads
every row's keys and values (≈8 MB at the average span) and runs ≈47 MFLOP of matmuls; the
bench times those kernels alone at the same shapes (``floor_seconds``), ≈4× HF's time, and
TorchEngine spends ≈1.7–2.5× that floor. ``bench engine --profile`` (``bench.engine_profile``)
says where the rest goes: of ≈130 torch operations a step, matmuls and attention are 16, the
norms 28 (four kernels each: ``normalize``), rope 6, KV writes 4, sampling 14, the running
batch's bookkeeping 10 and the step's other views and elementwise operations 38; prefilling the
joining prompts is ≈15% of the call. ``torch.compile`` (inductor, CPU) was tried on the decode
step: compiled pieces were no faster than eager, and the whole step needs static shapes (≈15 s
to compile each new batch/length) for ≈25% at best, so it is not used. Splitting the batch
between two Python threads (one torch thread each) was slower than one thread (≈2.0 ms against
≈1.4 ms a step: the GIL); two processes are not. With ``replicas`` (the rollout's engines pass
0: one per torch thread on a CPU) the engine forks copies of itself that decode side by side,
each with one thread, its share of the prefix cache and its own continuous batch
(``policy.replicas``): ≈1.1–1.2× one process on the tiny bench, ≈1.3× on SmolLM2 at batch 4
(docs/engines.md). With two threads on a shared machine both engines slow down several-fold
and the ratio swings between runs.

Pretrained models: Qwen3 and Llama-family weights (``decoder``), token-exact against HF
``generate`` on SmolLM2-135M-Instruct (tests/policy/test_torch_engine.py). The pool's rows and
cache slots come from the engine settings (``EngineConfig.max_rows``, ``cache_tokens``).

Not validated yet: CUDA and bfloat16 (bfloat16 is the default on CUDA; written device-agnostic,
exercised on CPU in float32 only), and a single prompt longer than the pool (refused with an
error). Requests join the batch in groups whose prompts fit in half the pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from trace_core.policy import decoder, native
from trace_core.policy.continuous import ContinuousBatch, Request
from trace_core.policy.decoder import (
    DecoderWeights,
    KVCache,
    LayerWeights,
    head_weights,
    layer_prefix,
    layer_weights,
)
from trace_core.policy.engine import Completion, EngineStats, SamplingParams, check_prompts
from trace_core.policy.prefix_cache import Node, PrefixCache
from trace_core.policy.replicas import ReplicaPool
from trace_core.policy.sampling import prompt_seeds, request_keys

UPSTREAM = (
    "transformers.PreTrainedModel.config",
    "transformers.PreTrainedModel.dtype",
    "torch.nn.utils.rnn.pad_sequence(sequences, /, batch_first)",
    "torch.nn.functional.pad(input, pad, /)",
)
"""What the engine calls in torch and transformers beside ``policy.decoder``'s
(``policy.upstream``: entry syntax there)."""

# Token slots of one prefill pass. Its activations, ~4 KB per token (the MLP's gate and up
# halves are the widest), then stay in a core's 2 MB L2 between the elementwise kernels;
# 512 ran the 64 × 32-token bench prefill in ≈0.8× the time of one 2048-token pass.
PASS_TOKENS = 512

MAX_REPLICAS = 8
"""Replicas an engine forks at most when it picks their number itself (``replicas=0``)."""


def _replicas(asked: int, device: torch.device) -> int:
    """Replicas an engine runs: only on a CPU, where ``asked`` 0 means one per torch thread."""
    if device.type != "cpu":
        return 1
    return asked or min(torch.get_num_threads(), MAX_REPLICAS)


# KV buffer storage kept between calls at most (bytes): enough for the tiny policy's usual
# calls; a larger one (long contexts × many rows) is given back after its call rather than
# held for the engine's lifetime.
_SCRATCH_KEEP_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Row:
    """A prefill row: run ``tokens`` after ``context``, whose KV is already in the pool."""

    context: torch.Tensor  # (c,) pool slots
    tokens: tuple[int, ...]
    fills: Node | None  # the node these tokens' KV goes to; None: a rerun for logits only
    logits_for: int | None  # the distinct prompt whose first-token logits this row yields


class TorchEngine:
    """The ``Engine`` protocol over Qwen3 or Llama weights (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        device: str | torch.device = "cpu",
        max_batch: int = 256,
        cache_tokens: int = 65_536,
        prefill_chunk: int = 16_384,
        dtype: torch.dtype | None = None,
        replicas: int = 1,
    ) -> None:
        """``max_batch``: decode rows at once (more run in turn; each holds its prompt's KV
        and ``max_tokens`` more columns); ``cache_tokens``: slots in the prefix-cache pool;
        ``prefill_chunk``: token columns (rows × width) of one prefill pass's KV buffer;
        ``dtype``: of the weights and KV (default: bfloat16 on CUDA, the model's on CPU);
        ``replicas``: on a CPU, forked copies that decode side by side, each with its share
        of the torch threads and of ``cache_tokens`` (``policy.replicas``; 0: one per torch
        thread, up to ``MAX_REPLICAS``); 1 decodes in this process."""
        if min(max_batch, cache_tokens, prefill_chunk) < 1:
            raise ValueError("max_batch, cache_tokens and prefill_chunk must be >= 1")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else model.dtype)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.stats = EngineStats()
        self.row_counts: Counter[int] = Counter()
        """Decode steps by their rows in flight, over every call."""
        self.weights = DecoderWeights.from_model(model, self.device, self.dtype)
        self.config = model.config
        if self.device.type == "cpu":  # loaded (built once) here: forked replicas inherit it
            native.decode_step()
        self.replicas = _replicas(replicas, self.device)
        self.cache_tokens = cache_tokens
        # Replicas hold the pool's slots between them (``policy.replicas``): one slot here.
        self.cache = PrefixCache(self.weights, cache_tokens if self.replicas == 1 else 1)
        self._scratch = torch.zeros(0)  # storage of the prefill KV buffers
        self._batch_storage = [torch.zeros(0), torch.zeros(0)]  # generate()'s running batches
        self.weights_version = 0
        """Bumped by every weight change: replicas forked before it have old weights."""
        self._pool: ReplicaPool | None = None

    def update_weights(self, model: PreTrainedModel) -> None:
        """Snapshot new weights (after a training step); the KV cached so far is dropped."""
        self.weights = DecoderWeights.from_model(model, self.device, self.dtype)
        self.config = model.config
        self.cache.clear()
        self.weights_version += 1

    def running_batch(self) -> ContinuousBatch | ReplicaPool:
        """The batch requests join: the replicas' (kept across calls), or a fresh one here."""
        if self.replicas > 1:
            if self._pool is None:
                self._pool = ReplicaPool(self, self.replicas)
            return self._pool
        return ContinuousBatch(self, self._batch_storage)

    def clear_cache(self) -> None:
        """Empty the prefix cache, the replicas' too."""
        self.cache.clear()
        if self._pool is not None:
            self._pool.clear_cache()

    @property
    def cache_used(self) -> int:
        """Prefix-cache slots holding KV, over the replicas when they decode."""
        return self._pool.cache_used if self._pool is not None else self.cache.used

    def close(self) -> None:
        """Stop the replicas, if any ran (the next call forks them again)."""
        if self._pool is not None:
            self._pool.close()

    def weight_sink(self) -> DecoderSink:
        """Where a weight sync's buckets go (``policy.weight_sync``): each layer is refolded
        and swapped in as soon as its tensors are in, so at most one layer is held twice."""
        return DecoderSink(self)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``seed``: one per prompt, or one for the call (prompt ``i`` then gets
        ``request_seed(seed, i)``), or None for fresh randomness. Every sample is a request of
        the engine's continuous batch (``policy.continuous``)."""
        prompt_list = [tuple(int(t) for t in p) for p in prompts]
        self._check(prompt_list, params)
        if not prompt_list:
            return []
        n = params.n
        keys = request_keys(prompt_seeds(seed, len(prompt_list)), n)
        batch = self.running_batch()
        if batch.pending:
            raise RuntimeError("this engine's running batch has requests in flight")
        steps, row_steps, counts = batch.steps, batch.row_steps, Counter(batch.row_counts)
        one = replace(params, n=1)
        out: list[Completion | None] = [None] * len(keys)
        try:
            for r, key in enumerate(keys):
                batch.add(Request(prompt_list[r // n], one, key), r)
            while batch.pending:
                batch.wait(1.0)
                for r, completion in batch.step():
                    out[r] = completion
        except BaseException:
            self.close()  # an interrupted call leaves nothing in flight on the replicas
            raise
        for i, kept in enumerate(self._batch_storage):
            if kept.numel() * kept.element_size() > _SCRATCH_KEEP_BYTES:
                self._batch_storage[i] = torch.zeros(0)
        if self._scratch.numel() * self._scratch.element_size() > _SCRATCH_KEEP_BYTES:
            self._scratch = torch.zeros(0)
        self.stats.calls += 1
        self.stats.prompt_tokens += sum(len(p) for p in prompt_list)
        extra = self.stats.extra
        extra["decode_steps"] = extra.get("decode_steps", 0.0) + batch.steps - steps
        extra["decode_row_steps"] = extra.get("decode_row_steps", 0.0) + batch.row_steps - row_steps
        self.row_counts.update(batch.row_counts - counts)
        if self._pool is None:  # the pool keeps its replicas' figures there itself
            extra["cache_used_tokens"] = float(self.cache.used)
            extra["evicted_tokens"] = float(self.cache.evicted_tokens)
        done = [c for c in out if c is not None]
        assert len(done) == len(out)
        return [done[i * n : (i + 1) * n] for i in range(len(prompt_list))]

    def _check(self, prompts: list[tuple[int, ...]], params: SamplingParams) -> None:
        spec = self.weights.spec
        check_prompts(prompts)
        for p in prompts:
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
        (rows × (longest context + longest new run); a single longer row runs alone) and that
        run ``PASS_TOKENS`` token slots at most (rows × longest new run)."""
        rows = sorted(rows, key=lambda r: -len(r.tokens))  # similar lengths pad little
        chunk: list[_Row] = []
        context = 0
        for row in rows:
            wider = max(context, len(row.context))
            n, width = len(chunk) + 1, len(chunk[0].tokens) if chunk else 0
            if chunk and (n * (wider + width) > self.prefill_chunk or n * width > PASS_TOKENS):
                self._run_chunk(chunk, logits)
                chunk, wider = [], len(row.context)
            chunk.append(row)
            context = wider
        if chunk:
            self._run_chunk(chunk, logits)

    def _run_chunk(self, rows: list[_Row], logits: torch.Tensor) -> None:
        w, dev = self.weights, self.device
        R, S = len(rows), len(rows[0].tokens)
        ctx = [len(r.context) for r in rows]
        C = max(ctx)
        kv = self._kv_buffer(R, C + S)
        if C:
            self._gather_context([r.context for r in rows], C, kv)
        tokens = torch.tensor([r.tokens + (0,) * (S - len(r.tokens)) for r in rows])  # (R, S)
        ctx_t = torch.tensor(ctx, device=dev)
        # Padding queries run at positions past their row's tokens: their writes land in
        # columns no real query of the row can see.
        positions = ctx_t[:, None] + torch.arange(S, device=dev)  # (R, S)
        hidden = decoder.forward(w, tokens.to(dev), positions, kv, span=C + S)  # (R, S, C)
        self.stats.prefill_tokens += sum(len(r.tokens) for r in rows)

        fill = [(i, r) for i, r in enumerate(rows) if r.fills is not None]
        if fill:
            slots = torch.cat([r.fills.slots for _, r in fill])  # type: ignore[union-attr,misc]
            runs = [(i, ctx[i], len(r.tokens)) for i, r in fill]
            self._store(kv, runs, slots)
        want = [(i, r.logits_for) for i, r in enumerate(rows) if r.logits_for is not None]
        if want:
            at = torch.tensor([i for i, _ in want], device=dev)
            last = torch.tensor([len(rows[i].tokens) - 1 for i, _ in want], device=dev)
            dest = torch.tensor([u for _, u in want], device=dev)
            logits[dest] = decoder.lm_logits(w, hidden[at, last])

    # -- KV movement -------------------------------------------------------------------------

    def _kv_buffer(self, rows: int, length: int) -> KVCache:
        """A (L, 2, rows, Hkv, length, D) buffer for one prefill pass or decode, over storage
        kept across calls (it grows to the largest call's size, up to ``_SCRATCH_KEEP_BYTES``).

        Fresh zeroed memory for every call cost about one decode step at batch 64 (≈1.3 ms:
        page faults and zeroing on ~12 MB). Reused storage holds stale values from earlier
        calls, all finite (zeros, or keys and values this engine computed), in columns every
        mask hides: they get probability exactly 0, and 0 · finite = 0.
        """
        s = self.weights.spec
        shape = (s.num_layers, 2, rows, s.num_kv_heads, length, s.head_dim)
        n = s.num_layers * 2 * rows * s.num_kv_heads * length * s.head_dim
        if self._scratch.numel() < n or self._scratch.dtype != self.weights.dtype:
            self._scratch = torch.zeros(n, dtype=self.weights.dtype, device=self.device)
        return KVCache(self._scratch[:n].view(shape))

    def _gather_context(self, slot_lists: list[torch.Tensor], width: int, kv: KVCache) -> None:
        """Copy each row's pool slots (a row's context) into columns 0.. of ``kv``; a row with
        fewer slots is padded with copies of slot 0, which the masks hide."""
        L, _, R, Hkv, _, D = kv.kv.shape
        table = _pad(slot_lists, width, self.device).flatten()  # (R·width,)
        rows = self.cache.kv.index_select(2, table).view(L, 2, R, width, Hkv, D)
        kv.kv[..., :width, :] = rows.transpose(3, 4)

    def _store(self, kv: KVCache, runs: list[tuple[int, int, int]], slots: torch.Tensor) -> None:
        """Copy runs (row, first column, length) of ``kv`` to the pool ``slots``, in order."""
        L, _, R, Hkv, T, D = kv.kv.shape
        row, first, length = (np.asarray(x) for x in zip(*runs, strict=True))
        offset = np.cumsum(length) - length  # where each run starts among the N tokens
        col = np.arange(length.sum()) + np.repeat(first - offset, length)  # (N,)
        index = (np.repeat(row, length)[:, None] * Hkv + np.arange(Hkv)) * T + col[:, None]
        index_t = torch.from_numpy(index.reshape(-1)).to(self.device)  # (N·Hkv,) rows of D
        picked = kv.kv.view(L, 2, R * Hkv * T, D).index_select(2, index_t)
        self.cache.kv.index_copy_(2, slots, picked.view(L, 2, -1, Hkv, D))  # (L, 2, N, Hkv, D)

    # -- decode (``policy.continuous``) --------------------------------------------------------

    def _cache_generated(self, seqs: list[tuple[int, tuple[int, ...]]], kv: KVCache) -> None:
        """Insert (batch row, prompt + completion) into the tree, copying the new KV to the pool.

        Best effort: when the pool has no room, the completions are simply not cached.
        """
        cache = self.cache
        source: dict[Node, int] = {}  # pending node -> a batch row that holds its tokens
        for b, seq in seqs:
            for node in cache.insert(seq):
                if node.slots is None:
                    source.setdefault(node, b)
        if not source:
            return
        nodes = list(source)
        sizes = [len(n.tokens) for n in nodes]
        slots = cache.alloc(sum(sizes))
        if slots is None:
            cache.discard(nodes)
            return
        runs = []
        for node, part in zip(nodes, slots.split(sizes), strict=True):
            start = sum(len(a.tokens) for a in node.ancestry()) - len(node.tokens)
            runs.append((source[node], start, len(node.tokens)))  # column = position
            node.slots = part
        self._store(kv, runs, slots)


def _pad(slot_lists: Sequence[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """Stack slot vectors into (N, width), padding with slot 0 (masked or overwritten later)."""
    table = torch.nn.utils.rnn.pad_sequence(list(slot_lists), batch_first=True)
    table = F.pad(table, (0, width - table.shape[1]))
    return table.to(device)


class DecoderSink:
    """``TorchEngine``'s ``WeightSink``: HF tensors in, ``DecoderWeights`` swapped layer by
    layer. The engine must not generate between ``begin`` and ``end``."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self._pending: dict[str, torch.Tensor] = {}
        self._wanted: dict[int, set[str]] = {}
        self._layers: list[LayerWeights] = []

    def begin(self, names: Sequence[str]) -> None:
        spec = self.engine.weights.spec
        self._pending, self._layers = {}, list(self.engine.weights.layers)
        self._wanted = {
            i: {n for n in names if n.startswith(layer_prefix(i))} for i in range(spec.num_layers)
        }
        if not all(self._wanted.values()) or "model.norm.weight" not in names:
            raise ValueError("the weights sent are not a whole decoder of this engine's shape")

    def take(self, tensors: Mapping[str, torch.Tensor]) -> None:
        engine, spec = self.engine, self.engine.weights.spec
        # Views of the sync's buffer where no cast or move is needed: a layer whose tensors
        # are all in is folded straight from them (the fold makes the engine's own copy).
        here = {n: v.to(engine.device, dtype=engine.dtype) for n, v in tensors.items()}
        state = {**self._pending, **here}
        for i, names in list(self._wanted.items()):
            if names <= state.keys():
                self._layers[i] = layer_weights(state, i, spec)
                for name in names:
                    del state[name]
                del self._wanted[i]
                engine.weights = replace(engine.weights, layers=tuple(self._layers))
        if (embed := state.pop("model.embed_tokens.weight", None)) is not None:
            engine.weights = replace(engine.weights, embed=embed.clone())
        # What waits for a later bucket must outlive this one's buffer.
        self._pending = {n: v.clone() if n in here else v for n, v in state.items()}

    def end(self) -> None:
        engine = self.engine
        if self._wanted:
            raise ValueError(f"the sync ended without layers {sorted(self._wanted)}")
        lm_head = head_weights(self._pending, engine.weights.embed, engine.config)
        engine.weights = replace(engine.weights, lm_head=lm_head)
        self._pending.clear()
        engine.cache.clear()  # its KV was computed with the old weights
        engine.weights_version += 1
