"""``TurnStream``: turns on a ``RayEnginePool``, each worker's answered the moment it is done.

The async driver of ``rollout.grow``. A lock-step call waits for its slowest sub-batch, and
then every worker waits while the driver steps the envs of all completions. A stream keeps
one queue per worker instead::

    stream = pool.stream(SamplingParams(max_tokens=48))
    stream.submit(histories, episodes, seeds)     # tags come back with their completions
    while stream.pending:
        for episode, completion in stream.next():  # one worker's sub-batch
            ...                                    # step its env; its next turn:
        stream.submit(next_histories, next_episodes, next_seeds)

``submit`` routes turns as a call's prompts are routed (``RayEnginePool._assign``: a prompt
stays on the worker that holds its longest prefix while that worker is under its fair share,
the work already queued or running on each worker counted in), and a worker with nothing
running starts its queue at once. ``next`` waits for any running sub-batch, and before it
returns, starts what has queued for that worker meanwhile: the worker decodes while the
caller steps envs. A worker runs one sub-batch at a time, so turns submitted while it runs
wait for its next (one engine call each, not one per turn).

Seeds: every turn carries its own (``rollout.turn.turn_seed``), and the engines sample each
request from its own (``sampling.KeyedDraws``, vLLM's per-request seed), so which turns meet
in a sub-batch, which depends on timing and on the number of workers, does not change what
they sample (up to float rounding in batched kernels). Faults: a sub-batch whose actor died is
started again, same turns and seed, on the least-loaded live worker
(``RayEnginePool._reroute``); turns queued for a worker gone for good are routed again. The
wait for a sub-batch is bounded by the pool's ``call_timeout_s`` (``rollout.waits``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import ray
from ray.exceptions import RayActorError

from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.rollout.routing import SubBatch
from trace_core.rollout.waits import Wait, first
from trace_core.rollout.worker_result import SubBatchResult

UPSTREAM = (
    "ray.get(object_refs, /)",
    "ray.exceptions.RayActorError",
    "ray.ObjectRef",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""

Tag = TypeVar("Tag")


class Pool(Protocol):
    """What a stream uses of its ``RayEnginePool``: its actors, routing and counters."""

    checkpoint: str
    stats: EngineStats
    _actors: list[Any]
    _live: list[int]
    _calls: int

    def _assign(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        queued: Mapping[int, float] | None = None,
    ) -> tuple[dict[int, list[int]], dict[int, float]]: ...

    def _record(
        self, worker: int, prompts: Sequence[list[int]], result: SubBatchResult
    ) -> None: ...

    def _learn_lengths(self, done: Sequence[Completion], params: SamplingParams) -> None: ...

    def _reroute(
        self,
        sub: SubBatch,
        err: RayActorError,
        pending: dict[ray.ObjectRef[SubBatchResult], SubBatch],
    ) -> SubBatch: ...

    def _submitted(self, call: int, plan: Sequence[SubBatch]) -> None: ...

    def _wait(self, workers: Sequence[int], what: str) -> Wait: ...


class TurnStream(Generic[Tag]):
    """Turns in flight on a pool (see the module docstring); ``params.n`` samples per turn."""

    def __init__(self, pool: Pool, params: SamplingParams) -> None:
        self._pool, self._params = pool, params
        self._prompts: dict[int, list[int]] = {}  # turn id -> prompt
        self._seeds: dict[int, int] = {}  # turn id -> its seed
        self._tags: dict[int, Tag] = {}
        self._work: dict[int, float] = {}  # turn id -> its routing work
        self._ids = 0
        self._queues: dict[int, list[int]] = {w: [] for w in pool._live}
        self._load = dict.fromkeys(pool._live, 0.0)  # work queued or running, per worker
        self._running: dict[ray.ObjectRef[SubBatchResult], SubBatch] = {}

    @property
    def pending(self) -> int:
        """Turns submitted and not answered yet."""
        return len(self._tags)

    def submit(
        self, prompts: Sequence[Sequence[int]], tags: Sequence[Tag], seeds: Sequence[int]
    ) -> None:
        """Queue one turn per prompt, each with its seed; ``next`` hands back its tag with its
        completions."""
        if not len(prompts) == len(tags) == len(seeds):
            raise ValueError(f"{len(prompts)} prompts, {len(tags)} tags and {len(seeds)} seeds")
        ids = list(range(self._ids, self._ids + len(prompts)))
        self._ids += len(prompts)
        for i, prompt, tag, seed in zip(ids, prompts, tags, seeds, strict=True):
            self._prompts[i], self._tags[i] = [int(t) for t in prompt], tag
            self._seeds[i] = int(seed)
        self._queue(ids)
        self._start_idle()

    def next(self) -> list[tuple[Tag, list[Completion]]]:
        """The turns of the next sub-batch any worker finishes, with their completions."""
        if not self._running:
            raise RuntimeError("nothing in flight: submit turns first")
        pool = self._pool
        while True:
            workers = [s.worker for s in self._running.values()]
            ref = first(list(self._running), pool._wait(workers, "a sub-batch of turns"))
            sub = self._running.pop(ref)
            try:
                result: SubBatchResult = ray.get(ref)
                break
            except RayActorError as err:
                moved = pool._reroute(sub, err, self._running)
                self._unload(sub)
                self._load[moved.worker] = self._load.get(moved.worker, 0.0) + moved.work
                self._running[self._send(moved)] = moved
                self._forget_dead()
        worker = sub.worker
        prompts = [self._prompts.pop(i) for i in sub.indices]
        pool._record(worker, prompts, result)
        done = [c for row in result.completions for c in row]
        pool._learn_lengths(done, self._params)
        pool.stats.calls += 1
        extra = pool.stats.extra
        extra["sub_batches"] = extra.get("sub_batches", 0.0) + 1
        self._unload(sub)
        if self._queues.get(worker):
            self._start(worker)  # before the caller steps the envs of this sub-batch
        for i in sub.indices:
            del self._work[i], self._seeds[i]
        return [
            (self._tags.pop(i), completions)
            for i, completions in zip(sub.indices, result.completions, strict=True)
        ]

    def _unload(self, sub: SubBatch) -> None:
        if sub.worker in self._load:
            self._load[sub.worker] = max(0.0, self._load[sub.worker] - sub.work)

    def _queue(self, ids: Sequence[int]) -> None:
        prompts = [self._prompts[i] for i in ids]
        by_worker, work = self._pool._assign(prompts, self._params, self._load)
        for w, positions in by_worker.items():
            share = work[w] / len(positions)  # a turn's share of its worker's new work
            for pos in positions:
                self._work[ids[pos]] = share
            self._queues[w].extend(ids[pos] for pos in positions)
            self._load[w] += work[w]

    def _start_idle(self) -> None:
        busy = {sub.worker for sub in self._running.values()}
        for w in list(self._queues):
            if self._queues[w] and w not in busy:
                self._start(w)

    def _start(self, worker: int) -> None:
        ids = tuple(self._queues[worker])
        self._queues[worker] = []
        seeds = tuple(self._seeds[i] for i in ids)
        sub = SubBatch(worker, ids, seeds, sum(self._work[i] for i in ids))
        self._running[self._send(sub)] = sub
        self._pool._calls += 1
        self._pool._submitted(self._pool._calls, [sub])

    def _send(self, sub: SubBatch) -> ray.ObjectRef[SubBatchResult]:
        pool = self._pool
        batch = [self._prompts[i] for i in sub.indices]
        actor = pool._actors[sub.worker]
        seeds = list(sub.seeds)
        return actor.generate.remote(batch, self._params, seeds, pool.checkpoint)  # type: ignore[no-any-return]

    def _forget_dead(self) -> None:
        """Workers gone for good: their queued turns are routed again among the live ones."""
        for w in [w for w in self._queues if w not in self._pool._live]:
            orphans = self._queues.pop(w)
            del self._load[w]
            if orphans:
                self._queue(orphans)
        self._start_idle()
