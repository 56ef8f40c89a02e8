"""``ContinuousStream``: turns on a ``RayEnginePool`` whose engine actors batch continuously;
the continuous driver of ``rollout.grow`` (``EngineConfig.driver = "continuous"``).

The async driver (``rollout.ray_stream``) sends a worker one sub-batch at a time, so a turn
whose env step is done waits for the slowest sequence of someone else's sub-batch, and the
batch an engine decodes shrinks as its rows finish. Here every turn goes to its worker the
moment it is submitted (``EngineWorker.submit``) and joins that engine's running batch at its
next step; the engine answers each turn the step it finishes (``rollout.batch_loop``). The
stream keeps one ``collect`` call in flight per worker and hands back whatever any worker has
answered, so the caller steps those envs and submits the next turns while every engine keeps
decoding. Same interface as ``TurnStream``::

    stream = pool.stream(SamplingParams(max_tokens=48))   # driver "continuous"
    stream.submit(histories, episodes, seeds)
    while stream.pending:
        for episode, completions in stream.next():
            ...

Routing is the pool's (``RayEnginePool._assign``: the worker holding a turn's longest prefix
while it is under its share of the work in flight, else the least loaded). Every turn carries
its seed, so what it samples does not depend on its worker or its batch.

Faults: an actor answers every call with its pid. When Ray restarts a dead actor (while it
has restarts left) the new process holds nothing, so the turns an earlier pid took are
submitted to it again, same seeds, as soon as any call shows the new pid; an actor gone for
good has its turns sent to the least-loaded live worker. A turn answered twice is handed back
once. The wait for the collects is bounded by the pool's ``call_timeout_s`` (``rollout.waits``):
an engine stuck in a step answers none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import ActorDiedError, RayActorError

from trace_core.policy.engine import Completion, SamplingParams
from trace_core.rollout.ray_stream import Pool
from trace_core.rollout.routing import SubBatch
from trace_core.rollout.waits import first
from trace_core.rollout.worker_result import Collected

UPSTREAM = (
    "ray.get(object_refs, /)",
    "ray.wait(ray_waitables, /, num_returns, timeout)",
    "ray.exceptions.ActorDiedError",
    "ray.exceptions.RayActorError",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""

Tag = TypeVar("Tag")

WAIT_S = 1.0
"""How long one ``collect`` call waits for a finished turn before it returns empty."""


class ContinuousStream(Generic[Tag]):
    """Turns in flight on a pool's continuously batching actors (see the module docstring)."""

    def __init__(self, pool: Pool, params: SamplingParams) -> None:
        self._pool, self._params = pool, params
        self._turns: dict[int, tuple[list[int], int, Tag]] = {}  # id -> prompt, seed, tag
        self._where: dict[int, int] = {}  # id -> worker
        self._work: dict[int, float] = {}  # id -> its routing work
        self._load = dict.fromkeys(pool._live, 0.0)
        self._collecting: dict[Any, int] = {}  # collect ref -> worker
        self._submits: dict[Any, tuple[int, list[int]]] = {}  # submit ref -> worker, turn ids
        self._taken: dict[int, int] = {}  # turn id -> pid of the process that took it
        self._pids: dict[int, int] = {}  # worker -> the newest pid it answered with
        self._ids = 0
        self.collects = 0

    @property
    def pending(self) -> int:
        return len(self._turns)

    def submit(
        self, prompts: Sequence[Sequence[int]], tags: Sequence[Tag], seeds: Sequence[int]
    ) -> None:
        """Send one turn per prompt, each with its seed, to its worker's running batch."""
        if not len(prompts) == len(tags) == len(seeds):
            raise ValueError(f"{len(prompts)} prompts, {len(tags)} tags and {len(seeds)} seeds")
        ids = list(range(self._ids, self._ids + len(prompts)))
        self._ids += len(prompts)
        for i, prompt, tag, seed in zip(ids, prompts, tags, seeds, strict=True):
            self._turns[i] = ([int(t) for t in prompt], int(seed), tag)
        self._send(ids)

    def next(self) -> list[tuple[Tag, list[Completion]]]:
        """The turns some worker answered: at least one, as soon as there is one."""
        if not self._turns:
            raise RuntimeError("nothing in flight: submit turns first")
        while True:
            self._check_submits()
            workers = list(self._collecting.values())
            ref = first(
                list(self._collecting), self._pool._wait(workers, "collect (their turns in flight)")
            )
            worker = self._collecting.pop(ref)
            try:
                pid, got = ray.get(ref)
            except RayActorError as err:
                self._lost(worker, err)
                continue
            self._seen(worker, pid)
            answered = self._answered(worker, got)
            self._collect(worker)
            if answered:
                return answered

    # -- sending and collecting --------------------------------------------------------------

    def _send(self, ids: list[int]) -> None:
        pool = self._pool
        prompts = [self._turns[i][0] for i in ids]
        by_worker, work = pool._assign(prompts, self._params, self._load)
        for w, positions in by_worker.items():
            share = work[w] / len(positions)
            chosen = [ids[p] for p in positions]
            for i in chosen:
                self._where[i], self._work[i] = w, share
            self._load[w] = self._load.get(w, 0.0) + work[w]
            self._submit(w, chosen)

    def _submit(self, worker: int, ids: list[int]) -> None:
        turns = [(i, self._turns[i][0], self._turns[i][1]) for i in ids]
        for i in ids:
            self._taken.pop(i, None)
        actor = self._pool._actors[worker]
        ref = actor.submit.remote(turns, self._params, self._pool.checkpoint)
        self._submits[ref] = (worker, ids)
        self._pool._calls += 1
        seeds = tuple(self._turns[i][1] for i in ids)
        self._pool._submitted(self._pool._calls, [SubBatch(worker, tuple(ids), seeds, 0.0)])
        if worker not in self._collecting.values():
            self._collect(worker)

    def _collect(self, worker: int) -> None:
        """Keep one collect in flight on ``worker`` while it has turns."""
        if worker in self._pool._live and any(w == worker for w in self._where.values()):
            ref = self._pool._actors[worker].collect.remote(WAIT_S)
            self._collecting[ref] = worker
            self.collects += 1

    def _check_submits(self) -> None:
        """Note which process took each finished submit's turns; raise what one raised (a
        refused engine, stale weights). A dead actor's submits are left to its collect."""
        if not self._submits:
            return
        done, _ = ray.wait(list(self._submits), num_returns=len(self._submits), timeout=0)
        for ref in done:
            worker, ids = self._submits.pop(ref)
            try:
                pid = ray.get(ref)
            except RayActorError:
                continue
            for i in ids:
                if self._where.get(i) == worker:
                    self._taken[i] = pid
            self._seen(worker, pid)

    def _seen(self, worker: int, pid: int) -> None:
        """``worker`` answered from ``pid``: a new process lost the turns an older one took,
        which go to it again."""
        if self._pids.get(worker, pid) != pid:
            lost = [
                i for i, w in self._where.items()
                if w == worker and self._taken.get(i, pid) != pid
            ]  # fmt: skip
            if lost:
                extra = self._pool.stats.extra
                extra["resubmitted_turns"] = extra.get("resubmitted_turns", 0.0) + len(lost)
                self._submit(worker, lost)
        self._pids[worker] = pid

    def _answered(self, worker: int, got: Collected | None) -> list[tuple[Tag, list[Completion]]]:
        if got is None or not got.ids:
            return []
        pool = self._pool
        prompts = [self._turns[i][0] for i in got.ids]
        pool._record(worker, prompts, got)
        pool._learn_lengths([c for cs in got.completions for c in cs], self._params)
        pool.stats.calls += 1
        out = []
        for i, completions in zip(got.ids, got.completions, strict=True):
            if i not in self._turns:  # answered twice (sent again after a fault): once only
                continue
            _, _, tag = self._turns.pop(i)
            del self._where[i]
            self._taken.pop(i, None)
            self._load[worker] = max(0.0, self._load.get(worker, 0.0) - self._work.pop(i))
            out.append((tag, completions))
        return out

    def _lost(self, worker: int, err: RayActorError) -> None:
        """``worker``'s actor died: its turns in flight go to the least-loaded live worker."""
        pool = self._pool
        if isinstance(err, ActorDiedError) and worker in pool._live:
            pool._live.remove(worker)  # restarts spent: gone for good
            pool.stats.extra["dead_workers"] = pool.stats.extra.get("dead_workers", 0.0) + 1
            self._load.pop(worker, None)
        if not pool._live:
            raise RuntimeError("every engine worker has died") from err
        orphans = [i for i, w in self._where.items() if w == worker]
        extra = pool.stats.extra
        extra["resubmitted_turns"] = extra.get("resubmitted_turns", 0.0) + len(orphans)
        candidates = [w for w in pool._live if w != worker] or pool._live
        target = min(candidates, key=lambda w: (self._load.get(w, 0.0), w))
        if worker in self._load:
            self._load[worker] = 0.0
        for i in orphans:
            self._where[i] = target
            self._load[target] = self._load.get(target, 0.0) + self._work[i]
        if orphans:
            self._submit(target, orphans)
