"""``ReplicaPool``: a CPU ``TorchEngine``'s running batch, split over forked copies of the
engine that decode side by side.

    engine = TorchEngine(model, replicas=2)      # on a CPU with two or more torch threads
    batch = engine.running_batch()               # this pool: add / wait / step, as a batch
    batch.add(Request(prompt, params, key), tag)
    while batch.pending:
        batch.wait(1.0)
        for tag, completion in batch.step(): ...

**Why.** On a CPU, a small policy's decode step is mostly the fixed cost of its ≈130 small
torch operations (a few µs each, whatever the rows), which more torch threads do not shrink:
two threads run the matmuls faster and everything else as slowly as one. Two processes with
one thread each run all of it side by side (``trace-rl bench engine``: the ratio against HF
``generate`` at the same threads, docs/engines.md).

**How.** The pool forks ``replicas`` copies of its engine, each with an equal share of the
engine's torch threads (at least one). A replica is a ``ContinuousBatch`` with its own prefix
cache (an equal share of the engine's ``cache_tokens``: the replicas hold as much KV as one
engine would, and the engine itself keeps one slot), stepped in its own process while it holds
requests; it sends back each step's answers with its counters. A request goes to the replica
whose prefix cache most likely holds its prompt's longest prefix (the pool records hashes of
every 16-token block boundary and of the whole prompt, for each request it routes and each
sequence answered), unless that replica has ``RELIEF`` more requests in flight than the least
loaded one; otherwise to the least loaded. So a prompt's samples share one prefill, and a
rollout's next turn finds its KV.

**Tokens.** A request samples with its own key (``sampling.KeyedDraws``), so a replica draws
the same tokens as the whole engine would (a test checks the bench workload token for token).

**Weights.** A replica has the weights its engine had when it was forked. New weights
(``update_weights``, a ``DecoderSink``) bump the engine's ``weights_version``; the pool then
forks afresh at its next request, once nothing is in flight (a request that comes after new
weights while older ones are in flight is refused). A replica that fails or dies stops the
pool with its error, and an interrupted ``generate`` stops it too; the next request forks
new ones.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import traceback
import weakref
from collections import Counter
from collections.abc import Hashable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch

from trace_core.policy.continuous import ContinuousBatch, Engine, Request
from trace_core.policy.engine import Completion
from trace_core.policy.prefix_cache import PrefixCache

BLOCK = 16
"""Tokens between the prefix hashes the router records and looks up."""

RELIEF = 8
"""A request leaves the replica holding its prefix when that one has this many more requests
in flight than the least loaded: a shared system prompt must not pile every rollout on one."""

MAX_HOMES = 1 << 20
"""Prefix hashes the router keeps at most (then it starts over; only speed depends on it)."""

_COUNTERS = ("steps", "row_steps", "prefill_tokens", "generated_tokens")


class TorchEngine(Engine, Protocol):
    """What a pool uses of its ``TorchEngine`` beside what a batch does."""

    replicas: int
    cache_tokens: int
    weights_version: int
    _pool: ReplicaPool | None
    _batch_storage: list[torch.Tensor]


class ReplicaError(RuntimeError):
    """A replica failed or died; its traceback or exit status is in the message."""


def block_hashes(tokens: tuple[int, ...]) -> list[int]:
    """Hashes of ``tokens``' prefixes at every ``BLOCK`` boundary, then of the whole (chained:
    each covers the whole prefix, in time linear in its length)."""
    out, h = [], 0
    for at in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        h = hash((h, tokens[at : at + BLOCK]))
        out.append(h)
    if len(tokens) % BLOCK:
        out.append(hash((h, tokens[len(tokens) - len(tokens) % BLOCK :])))
    return out


class ReplicaPool:
    """``TorchEngine``'s running batch over forked replicas (see the module docstring): the
    ``RunningBatch`` protocol of ``rollout.batch_loop``."""

    def __init__(self, engine: TorchEngine, replicas: int) -> None:
        if replicas < 2:
            raise ValueError(f"replicas: a pool needs 2 or more, got {replicas}")
        self.engine, self.replicas = engine, replicas
        self.steps = 0
        self.row_steps = 0
        self.row_counts: Counter[int] = Counter()
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._version = -1  # the engine's weights_version the replicas were forked with
        self._load = [0] * replicas  # requests in flight, by replica
        self._outbox: list[list[tuple[Request, int]]] = [[] for _ in range(replicas)]
        self._flight: dict[int, tuple[Any, tuple[int, ...]]] = {}  # number -> tag, prompt
        self._numbers = 0
        self._homes: dict[int, int] = {}  # prefix hash -> the replica that holds it
        self._used = [0] * replicas  # prefix-cache slots in use, by replica
        self._evicted = [0] * replicas
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns)

    @property
    def pending(self) -> int:
        return sum(self._load)

    @property
    def cache_used(self) -> int:
        return sum(self._used)

    def add(self, request: Request, tag: Hashable | Any = None) -> None:
        self.engine._check([request.prompt], request.params)
        self._start()
        r = self._route(request.prompt)
        self._numbers += 1
        self._flight[self._numbers] = (tag, request.prompt)
        self._outbox[r].append((request, self._numbers))
        self._load[r] += 1

    def wait(self, timeout: float) -> None:
        """Until some replica has answers (or ``timeout``); at once when requests wait to go."""
        if self.pending and not any(self._outbox):
            wait(self._conns, timeout)

    def step(self) -> list[tuple[Any, Completion]]:
        """Send the requests routed since the last step; hand back every answer in so far."""
        for r, box in enumerate(self._outbox):
            if box:
                try:
                    self._conns[r].send(("add", box))
                except OSError:  # its end of the pipe is closed: it is gone
                    raise self._died(r) from None
                self._outbox[r] = []
        answers: list[tuple[Any, Completion]] = []
        ready = wait(self._conns, 0) if self.pending else []
        for r, conn in enumerate(list(self._conns)):
            while conn in ready and not conn.closed and conn.poll():
                answers += self._receive(r)
        return answers

    def clear_cache(self) -> None:
        """Empty every replica's prefix cache (after the requests sent so far)."""
        for conn in self._conns:
            conn.send(("clear", None))
        self._homes.clear()
        self._used = [0] * self.replicas

    def close(self) -> None:
        """Stop the replicas (they are forked again by the next request)."""
        _shutdown(self._procs, self._conns)
        self._load = [0] * self.replicas
        self._outbox = [[] for _ in range(self.replicas)]
        self._flight.clear()
        self._homes.clear()

    # -- the replicas ------------------------------------------------------------------------

    def _start(self) -> None:
        """Fork the replicas, unless they run with the engine's current weights."""
        engine = self.engine
        gone = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        if self._procs and not gone and self._version == engine.weights_version:
            return
        if self.pending and gone:
            raise self._died(gone[0])
        if self.pending:
            raise RuntimeError(
                f"{self.pending} requests are in flight on this engine's replicas, which have "
                "older weights: new weights go in between batches"
            )
        self.close()
        threads = max(1, torch.get_num_threads() // self.replicas)
        context = multiprocessing.get_context("fork")
        for _ in range(self.replicas):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(engine, theirs, threads, self.replicas),
                daemon=True,
                name="engine-replica",
            )
            process.start()
            theirs.close()
            self._procs.append(process)
            self._conns.append(mine)
        self._version = engine.weights_version
        self._used = [0] * self.replicas

    def _route(self, prompt: tuple[int, ...]) -> int:
        least = min(range(self.replicas), key=self._load.__getitem__)
        hashes = block_hashes(prompt)
        home = next((self._homes[h] for h in reversed(hashes) if h in self._homes), None)
        r = home if home is not None and self._load[home] < self._load[least] + RELIEF else least
        self._remember(hashes, r)
        return r

    def _remember(self, hashes: list[int], r: int) -> None:
        if len(self._homes) > MAX_HOMES:
            self._homes.clear()
        for h in hashes:
            self._homes.setdefault(h, r)

    def _died(self, r: int) -> ReplicaError:
        """Stop the pool after replica ``r`` is found gone: the error that says how."""
        process = self._procs[r]
        process.join(timeout=5)
        code = process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else code
        self.close()
        return ReplicaError(f"engine replica {r} died ({how}: pid {process.pid})")

    def _receive(self, r: int) -> list[tuple[Any, Completion]]:
        try:
            kind, body = self._conns[r].recv()
        except (EOFError, OSError):
            raise self._died(r) from None
        if kind == "error":
            self.close()
            raise ReplicaError(f"engine replica {r} failed:\n{body}")
        answers, counters = body
        stats = self.engine.stats
        self.steps += counters["steps"]
        self.row_steps += counters["row_steps"]
        self.row_counts.update(counters["row_counts"])
        stats.prefill_tokens += counters["prefill_tokens"]
        stats.generated_tokens += counters["generated_tokens"]
        self._used[r], self._evicted[r] = counters["cache_used"], counters["evicted"]
        stats.extra["cache_used_tokens"] = float(sum(self._used))
        stats.extra["evicted_tokens"] = float(sum(self._evicted))
        out = []
        for number, completion in answers:
            tag, prompt = self._flight.pop(number)
            self._load[r] -= 1
            self._remember(block_hashes(prompt + tuple(completion.token_ids.tolist())), r)
            out.append((tag, completion))
        return out


def _serve(engine: TorchEngine, conn: Connection, threads: int, replicas: int) -> None:
    """A replica's life: its share of the prefix-cache slots, then take requests, step its
    batch while it holds any, send the answers of each step that has some (with the counters
    since the last send)."""
    torch.set_num_threads(threads)
    engine.cache = PrefixCache(engine.weights, max(1, engine.cache_tokens // replicas))
    pool = engine._pool
    if pool is not None:  # the engine's copy: not this process's to stop or talk through
        pool._finalizer.detach()
        for other in pool._conns:  # the engine's ends of the replicas forked before
            other.close()
    engine.replicas, engine._pool = 1, None  # this copy decodes in process
    batch = ContinuousBatch(engine, engine._batch_storage)
    marks = _counters(engine, batch)
    counts = Counter(batch.row_counts)
    try:
        while True:
            while conn.poll(0 if batch.pending else None):
                kind, body = conn.recv()
                if kind == "stop":
                    return
                if kind == "clear":
                    engine.cache.clear()
                for request, number in body or ():
                    batch.add(request, number)
            answers = batch.step()
            if answers:
                now = _counters(engine, batch)
                counters: dict[str, Any] = {k: now[k] - marks[k] for k in _COUNTERS}
                counters.update(
                    row_counts=batch.row_counts - counts,
                    cache_used=engine.cache.used,
                    evicted=engine.cache.evicted_tokens,
                )
                marks, counts = now, Counter(batch.row_counts)
                conn.send(("done", (answers, counters)))
    except (EOFError, KeyboardInterrupt):
        return  # the engine's process is gone or stopping
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _counters(engine: TorchEngine, batch: ContinuousBatch) -> dict[str, int]:
    stats = engine.stats
    return {
        "steps": batch.steps,
        "row_steps": batch.row_steps,
        "prefill_tokens": stats.prefill_tokens,
        "generated_tokens": stats.generated_tokens,
    }


def _shutdown(procs: list[BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # already gone
            conn.send(("stop", None))
    for process in procs:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
