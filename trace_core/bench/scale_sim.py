"""A discrete-event simulation of one rollout iteration on W engine workers.

Input: a ``TurnStream`` (``scale_trace``: every turn's prompt, generated and observation
tokens, env step seconds and what it waits for), a ``CostModel`` (seconds per prefilled and
decoded token on one worker, and the driver's costs) and a ``Variant`` (how the iteration is
scheduled). Output: a ``SimResult`` with the makespan, the workers' busy share, tokens/s and
the prompt tokens served from the workers' prefix caches. Deterministic given the seed (only
``random`` routing draws from it).

**Workers.** A worker runs a batch of requests as one engine call, as ``TorchEngine`` does:
``call_s``, then ``prompt_token_s`` per prompt token (cache look-up, KV copy), the
prefill of each prompt's uncached tail, then decode steps until its
longest sample ends. A step costs ``decode_step_s + decode_row_s · rows +
decode_context_s · attended columns of the rows``; when finished rows leave the step and
how wide the attention is follow ``TorchEngine`` (``batch_features``). With ``continuous``
(vLLM) a finished row's slot is refilled; without, rows run in chunks of ``max_batch``.
Each worker keeps a prefix cache of unbounded size: after it runs a turn it holds that
turn's prompt and generated tokens, and a later prompt of the same tree hits its longest
cached prefix.
Identical prompts in one batch (a prompt's roots) are prefilled once.

**Driver.** ``lock-step`` is what ``rollout.grow`` does: one engine call per turn-step for
every live turn of every tree, split across the workers, all awaited before the driver
steps the envs of all completions (``env_seconds`` + ``driver_turn_s`` each, serially, one
Python process) and routes the next call (``route_token_s`` per prompt token, the prefix
hashing; ``transport_s`` per call). ``async`` lets every worker start its next batch as
soon as it is free: the driver handles each returned sub-batch on its own (same costs, still
one process: its jobs queue) and routes the turns it frees to the workers' queues at once.
A ``continuous`` (vLLM) worker admits them at once, into the steps of the rows already
decoding there (approximately: the newcomers pay for the rows in flight, those rows are not
slowed by the newcomers); a TorchEngine worker runs them in its next call.
The ``continuous`` driver (``rollout.ray_continuous``) sends every turn on its own: a worker
admits it at once while fewer than ``max_batch`` rows are in flight there (later ones wait
in its queue for a row), it shares the steps of the rows in flight as above, and it comes
back the moment its own last token is out, so the driver steps its env without waiting for
the rest of a sub-batch. Each turn pays ``call_s`` once (its admission).

**Routing** (per group of identical prompts, heaviest first, as ``rollout.routing``):
``affinity`` keeps a group on the worker that holds its longest prefix while that worker
stays under (1 + slack) × the fair share of work, else sends it where it would finish first
(``split_work``'s rule); ``least-loaded`` ignores the caches and sends every group where its
full prefill and expected decode finish first; ``random`` draws a worker. Work is counted in
tokens: prefill tokens plus expected generated tokens.

**Stage 2.** ``local``: a tree's continuations start once its own root rollouts are done
(``grow_trees``). ``barrier``: once every tree's are.

Not modelled: cache eviction (the caches here never fill), a worker's memory limit on rows
(a batch of more than ``max_batch`` rows runs in turns), network time beyond ``transport_s``,
and vLLM's chunked prefill interleaving with decode.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from trace_core.bench.scale_trace import TurnStream, flat_stream

Routing = Literal["affinity", "least-loaded", "random"]
Driver = Literal["lock-step", "async", "continuous"]


@dataclass(frozen=True)
class CostModel:
    """Seconds of one worker's engine and of the driver (``scale`` fits and ships these)."""

    call_s: float
    """Engine time per call on a worker, whatever its size."""
    prefill_token_s: float
    """Per prefilled token."""
    prefill_attention_s: float
    """Per prefilled token per token of context before it (attention)."""
    prompt_token_s: float
    """Per prompt token of every row, cached or not: the cache look-up and the copy of its KV
    into the decode batch (``TorchEngine``; about 0 for vLLM's paged blocks)."""
    decode_step_s: float
    """Per decode step, whatever the rows (reading the weights)."""
    decode_row_s: float
    """Per row in a decode step (one generated token)."""
    decode_context_s: float
    """Per row per context token in a decode step (reading its KV)."""
    decode_copy_s: float = 0.0
    """Per row × column of KV copied when done rows leave a ``TorchEngine`` batch."""
    max_batch: int = 256
    """Rows decoded at once."""
    continuous: bool = False
    """Finished rows are replaced at once (vLLM) instead of chunk by chunk (TorchEngine)."""
    transport_s: float = 0.0
    """Driver ↔ worker round trip of one sub-batch (Ray)."""
    route_token_s: float = 0.0
    """Driver seconds per prompt token routed (prefix hashing in ``rollout.routing``)."""
    driver_turn_s: float = 0.0
    """Driver seconds per turn besides the env step: decode the action, tokenise the reply."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, float) and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value}")
        if self.max_batch < 1:
            raise ValueError(f"cost model: max_batch must be >= 1, got {self.max_batch}")


@dataclass(frozen=True)
class Variant:
    name: str
    workload: Literal["flat", "trace"]
    """``flat``: GRPO at the same budget (``scale_trace.flat_stream``); ``trace``: the trees."""
    stage2: Literal["local", "barrier"]
    routing: Routing
    driver: Driver


VARIANTS = (
    Variant("grpo", "flat", "local", "affinity", "lock-step"),
    Variant("trace", "trace", "local", "affinity", "lock-step"),
    Variant("trace-barrier", "trace", "barrier", "affinity", "lock-step"),
    Variant("trace-least-loaded", "trace", "local", "least-loaded", "lock-step"),
    Variant("trace-random", "trace", "local", "random", "lock-step"),
    Variant("trace-async", "trace", "local", "affinity", "async"),
    Variant("trace-async-barrier", "trace", "barrier", "affinity", "async"),
    Variant("trace-continuous", "trace", "local", "affinity", "continuous"),
)
"""The compared schedules; ``trace`` is what ``grow_trees`` on a ``RayEnginePool`` does."""
BASELINE = "trace"


@dataclass(frozen=True)
class SimResult:
    variant: str
    workers: int
    makespan_s: float
    utilisation: float
    """Workers' busy seconds / (makespan × workers)."""
    tokens_per_s: float
    """Generated tokens / makespan."""
    generated_tokens: int
    prompt_tokens: int
    prefill_tokens: int
    cache_hit_tokens: int
    """Prompt tokens a worker's cache already held (prompt = prefill + hits)."""
    engine_calls: int
    """Sub-batches run by workers."""
    driver_s: float
    """Seconds the driver spent stepping envs and routing."""
    imbalance: float
    """Lock-step: worker seconds spent waiting for the slowest worker of a call / (makespan ×
    workers); 0 for async."""


COEFFICIENTS = (
    "call_s", "prefill_token_s", "prefill_attention_s", "prompt_token_s",
    "decode_step_s", "decode_row_s", "decode_context_s", "decode_copy_s",
)  # fmt: skip
"""The ``CostModel`` fields a call's seconds are linear in (``batch_features``)."""


def batch_seconds(
    cost: CostModel,
    prefill: npt.NDArray[np.int64],
    cached: npt.NDArray[np.int64],
    generated: npt.NDArray[np.int64],
) -> float:
    """One engine call of these rows (per row: prefilled, cached and generated tokens)."""
    features = batch_features(prefill, cached, generated, cost.max_batch, cost.continuous)
    return float(features @ np.array([getattr(cost, name) for name in COEFFICIENTS]))


def batch_features(
    prefill: npt.NDArray[np.int64],
    cached: npt.NDArray[np.int64],
    generated: npt.NDArray[np.int64],
    max_batch: int,
    continuous: bool,
) -> npt.NDArray[np.float64]:
    """What one call's seconds are linear in, one entry per ``COEFFICIENTS`` name: 1 call,
    prefilled tokens, prefilled × earlier tokens, prompt tokens of all rows, decode steps,
    row-steps, row-steps × attended columns, rows × columns copied when done rows leave.
    ``calibrate`` fits the coefficients to these.

    ``TorchEngine`` (not ``continuous``), chunk by chunk of ``max_batch`` rows: the first
    token comes with the prefill; decode step t feeds every live row's last token, and its
    attention spans the longest live prompt + t + 1 columns (rows are padded to it); a row of
    g tokens is done after step g - 1, and done rows leave only once a quarter of the live
    rows are done (dropping them costs a copy), so they keep paying until then.
    vLLM (``continuous``): a row of g tokens takes g - 1 steps over its own context, a done
    row's slot is refilled at once, so the steps are at least Σ (g - 1) / ``max_batch``.
    """
    prompt = prefill + cached
    out = np.zeros(len(COEFFICIENTS))
    out[:4] = 1.0, prefill.sum(), (prefill * (cached + prefill / 2)).sum(), prompt.sum()
    if generated.size == 0:
        return out
    if continuous:
        steps = np.maximum(generated - 1, 0)
        out[4] = max(int(steps.max()), math.ceil(steps.sum() / max_batch))
        out[5] = steps.sum()
        out[6] = (steps * prompt + steps * (steps + 1) / 2).sum()
        return out
    for lo in range(0, len(generated), max_batch):
        live_gen = generated[lo : lo + max_batch].tolist()
        live_prompt = prompt[lo : lo + max_batch].tolist()
        longest = max(live_prompt)
        for t in range(max(live_gen)):
            n = len(live_gen)
            out[4] += 1
            out[5] += n
            out[6] += n * (longest + t + 1)
            done = sum(g <= t + 1 for g in live_gen)
            if done == n:
                break
            if 4 * done >= n:
                keep = [i for i, g in enumerate(live_gen) if g > t + 1]
                out[7] += len(keep) * (longest + t + 1)
                live_gen = [live_gen[i] for i in keep]
                live_prompt = [live_prompt[i] for i in keep]
                longest = max(live_prompt)
    return out


def assign(
    owners: Sequence[int | None],
    home: Sequence[float],
    away: Sequence[float],
    loads: npt.NDArray[np.float64],
    routing: Routing,
    slack: float,
    rng: np.random.Generator,
) -> list[int]:
    """A worker for each group. ``affinity`` is ``rollout.routing.split_work`` starting from
    the workers' current ``loads`` (updated in place); the others as the module docstring."""
    workers = len(loads)
    chosen = [-1] * len(owners)
    if routing == "random":
        picks = rng.integers(0, workers, size=len(owners))
        for g, w in enumerate(picks.tolist()):
            chosen[g] = w
            loads[w] += home[g] if owners[g] == w else away[g]
        return chosen
    rest = list(range(len(owners)))
    if routing == "affinity":
        cap = (loads.sum() + sum(home)) / workers * (1 + slack)
        rest = []
        for g in sorted(range(len(owners)), key=lambda g: -home[g]):
            owner = owners[g]
            if owner is not None and loads[owner] + home[g] <= cap:
                chosen[g] = owner
                loads[owner] += home[g]
            else:
                rest.append(g)
    for g in sorted(rest, key=lambda g: -away[g]):
        cost = np.full(workers, away[g])
        owner = owners[g]
        if routing == "affinity" and owner is not None:
            cost[owner] = home[g]
        w = int(np.argmin(loads + cost))  # ties go to the lowest id, as split_work's do
        chosen[g] = w
        loads[w] += home[g] if owner == w else away[g]
    return chosen


class _Cluster:
    """Workers' prefix caches and the stage gates of one simulated iteration."""

    def __init__(self, stream: TurnStream, workers: int, stage2: str) -> None:
        self.s = stream
        self.known: list[dict[int, int]] = [{} for _ in range(workers)]  # key -> tokens held
        self.owner: dict[int, int] = {}  # key -> worker that last extended it
        self.children = stream.children()
        self.stage1_left = np.bincount(stream.tree[stream.stage == 1], minlength=stream.trees)
        self.all_stage1_left = int(self.stage1_left.sum())
        self.held: dict[int, list[int]] = {}  # tree -> branch rows waiting for stage 1
        self.barrier = stage2 == "barrier"
        self.gen_estimate = float(stream.generated_tokens.mean()) if stream.turns else 0.0
        self.prefill = self.hits = 0

    def _parent_key(self, row: int) -> int:
        p = int(self.s.parent[row])
        return p if p >= 0 else -1 - int(self.s.tree[row])  # a tree's prompt: a negative key

    def _chain(self, row: int) -> list[int]:
        keys, p = [], int(self.s.parent[row])
        while p >= 0:
            keys.append(p)
            p = int(self.s.parent[p])
        keys.append(-1 - int(self.s.tree[row]))
        return keys

    def cached(self, row: int, worker: int) -> int:
        known = self.known[worker]
        return next((known[k] for k in self._chain(row) if k in known), 0)

    def owner_of(self, row: int) -> int | None:
        return next((self.owner[k] for k in self._chain(row) if k in self.owner), None)

    def run(
        self, rows: Sequence[int], worker: int, cost: CostModel, sharing: tuple[int, int] = (0, 0)
    ) -> float:
        """Seconds of ``rows`` as one call on ``worker``; its cache then holds them.
        ``sharing``: (rows, context tokens) already decoding there, whose share of every
        decode step these rows also wait for (vLLM's continuous batching)."""
        n = len(rows)
        prefill, cached, gen = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        known = self.known[worker]
        for i, row in enumerate(rows):
            prompt = int(self.s.prompt_tokens[row])
            cached[i] = min(self.cached(row, worker), prompt)
            prefill[i] = prompt - cached[i]
            gen[i] = self.s.generated_tokens[row]
            parent = self._parent_key(row)
            known[parent] = max(known.get(parent, 0), prompt)
            known[row] = max(known.get(row, 0), prompt + int(gen[i]))
            self.owner[parent] = self.owner[row] = worker
        self.prefill += int(prefill.sum())
        self.hits += int(cached.sum())
        features = batch_features(prefill, cached, gen, cost.max_batch, cost.continuous)
        features[5] += sharing[0] * features[4]
        features[6] += sharing[1] * features[4]
        return float(features @ np.array([getattr(cost, name) for name in COEFFICIENTS]))

    def route(
        self, rows: Sequence[int], loads: npt.NDArray[np.float64], routing: Routing,
        rng: np.random.Generator, slack: float = 0.15,
    ) -> dict[int, list[int]]:  # fmt: skip
        """Rows by worker; identical prompts (same tree and parent) move together."""
        groups: dict[int, list[int]] = {}
        for row in rows:
            groups.setdefault(self._parent_key(row), []).append(row)
        members = list(groups.values())
        owners, home, away = [], [], []
        for g in members:
            owner = self.owner_of(g[0]) if routing == "affinity" else None
            prompt = float(self.s.prompt_tokens[g[0]])
            tail = prompt - (self.cached(g[0], owner) if owner is not None else 0)
            decode = len(g) * self.gen_estimate
            owners.append(owner)
            home.append(tail + decode)
            away.append(prompt + decode)
        by_worker: dict[int, list[int]] = {}
        for g, w in zip(
            members, assign(owners, home, away, loads, routing, slack, rng), strict=True
        ):
            by_worker.setdefault(w, []).extend(g)
        return by_worker

    def complete(self, rows: Sequence[int]) -> list[int]:
        """Rows that may start now that ``rows`` (and their env steps) are done."""
        ready: list[int] = []
        for row in rows:
            for child in self.children[row]:
                if self.s.branch[child]:
                    self.held.setdefault(int(self.s.tree[child]), []).append(child)
                else:
                    ready.append(child)
            if self.s.stage[row] == 1:
                tree = int(self.s.tree[row])
                self.stage1_left[tree] -= 1
                self.all_stage1_left -= 1
                if not self.barrier and self.stage1_left[tree] == 0:
                    ready.extend(self.held.pop(tree, []))
        if self.barrier and self.all_stage1_left == 0:
            for tree in sorted(self.held):
                ready.extend(self.held.pop(tree))
        return ready

    def driver_seconds(
        self, completed: Sequence[int], routed: Sequence[int], cost: CostModel
    ) -> float:
        env = float(self.s.env_seconds[list(completed)].sum()) if completed else 0.0
        tokens = float(self.s.prompt_tokens[list(routed)].sum()) if routed else 0.0
        return env + cost.driver_turn_s * len(completed) + cost.route_token_s * tokens


def simulate(
    stream: TurnStream, variant: Variant, workers: int, cost: CostModel, seed: int = 0
) -> SimResult:
    """One iteration of ``stream`` under ``variant`` on ``workers`` workers."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if variant.workload == "flat":
        stream = flat_stream(stream)
    rng = np.random.default_rng(seed)
    cluster = _Cluster(stream, workers, variant.stage2)
    busy = np.zeros(workers)
    first = [int(r) for r in np.flatnonzero(stream.parent < 0)]
    if variant.driver == "lock-step":
        clock, calls, driver, waiting = _lock_step(cluster, first, variant, cost, busy, rng)
    else:
        clock, calls, driver = _async(cluster, first, variant, cost, busy, rng)
        waiting = 0.0
    generated = int(stream.generated_tokens.sum())
    span = max(clock, 1e-12)
    return SimResult(
        variant=variant.name,
        workers=workers,
        makespan_s=clock,
        utilisation=float(busy.sum()) / (span * workers),
        tokens_per_s=generated / span,
        generated_tokens=generated,
        prompt_tokens=int(stream.prompt_tokens.sum()),
        prefill_tokens=cluster.prefill,
        cache_hit_tokens=cluster.hits,
        engine_calls=calls,
        driver_s=driver,
        imbalance=waiting / (span * workers),
    )


def _lock_step(
    cluster: _Cluster, ready: list[int], variant: Variant, cost: CostModel,
    busy: npt.NDArray[np.float64], rng: np.random.Generator,
) -> tuple[float, int, float, float]:  # fmt: skip
    clock = driver = waiting = 0.0
    calls = 0
    routed: list[int] = ready
    clock += cluster.driver_seconds([], routed, cost)
    driver += clock
    while ready:
        by_worker = cluster.route(ready, np.zeros(len(busy)), variant.routing, rng)
        seconds = {w: cluster.run(rows, w, cost) for w, rows in sorted(by_worker.items())}
        longest = max(seconds.values())
        for w, s in seconds.items():
            busy[w] += s
        waiting += longest * len(busy) - sum(seconds.values())
        calls += len(seconds)
        nxt = cluster.complete(ready)
        step = cluster.driver_seconds(ready, nxt, cost)
        clock += cost.transport_s + longest + step
        driver += step
        ready = nxt
    return clock, calls, driver, waiting


def _async(
    cluster: _Cluster, ready: list[int], variant: Variant, cost: CostModel,
    busy: npt.NDArray[np.float64], rng: np.random.Generator,
) -> tuple[float, int, float]:  # fmt: skip
    workers = len(busy)
    queues: list[list[int]] = [[] for _ in range(workers)]
    loads = np.zeros(workers)  # tokens of work queued or running on each worker
    work = {}  # row -> its share of its worker's load
    running = [False] * workers
    events: list[tuple[float, int, str, int, list[int]]] = []  # (time, seq, kind, worker, rows)
    seq = 0
    calls = 0
    driver_free = driver = clock = 0.0

    flight = np.zeros((workers, 2), dtype=np.int64)  # continuous: rows, context decoding
    busy_until = np.zeros(workers)

    per_turn = variant.driver == "continuous"
    shared = cost.continuous or per_turn  # new rows join the steps of those in flight

    def start(w: int, rows_w: list[int], now: float) -> None:
        nonlocal seq, calls
        share = (int(flight[w, 0]), int(flight[w, 1])) if shared else (0, 0)
        end = now + cost.transport_s + cluster.run(rows_w, w, cost, share)
        busy[w] += max(0.0, end - max(now + cost.transport_s, busy_until[w]))
        busy_until[w] = max(busy_until[w], end)
        flight[w] += len(rows_w), int(cluster.s.prompt_tokens[rows_w].sum())
        running[w] = True
        calls += 1
        seq += 1
        heapq.heappush(events, (end, seq, "done", w, rows_w))

    def enqueue(rows: list[int], now: float) -> None:
        before = loads.copy()
        for w, group in cluster.route(rows, loads, variant.routing, rng).items():
            share = (loads[w] - before[w]) / max(len(group), 1)
            for row in group:
                work[row] = share
            queues[w].extend(group)
        for w in range(workers):
            # A TorchEngine call is atomic: the next waits for it. vLLM admits new rows at
            # its next step: they start now and share the steps with the rows in flight.
            # Per turn: each starts alone while the worker has a free row.
            if per_turn:
                while queues[w] and flight[w, 0] < cost.max_batch:
                    start(w, [queues[w].pop(0)], now)
            elif queues[w] and (cost.continuous or not running[w]):
                rows_w, queues[w] = queues[w], []
                start(w, rows_w, now)

    def drive(rows: list[int], now: float) -> None:
        nonlocal seq, driver_free, driver
        start = max(now, driver_free)
        nxt = cluster.complete(rows)
        took = cluster.driver_seconds(rows, nxt, cost)
        driver_free = start + took
        driver += took
        seq += 1
        heapq.heappush(events, (driver_free, seq, "routed", -1, nxt))

    enqueue(ready, cluster.driver_seconds([], ready, cost))
    driver = driver_free = cluster.driver_seconds([], ready, cost)
    while events:
        clock, _, kind, w, rows = heapq.heappop(events)
        if kind == "done":
            flight[w] -= len(rows), int(cluster.s.prompt_tokens[rows].sum())
            running[w] = bool(flight[w, 0])
            for row in rows:
                loads[w] -= work.pop(row, 0.0)
            drive(rows, clock)
            enqueue([], clock)  # a free worker takes what is already queued for it
        else:
            enqueue(rows, clock)
    return clock, calls, driver
