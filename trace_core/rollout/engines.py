"""The one engine factory: an ``EngineConfig`` and a policy checkpoint in, an ``Engine`` out.

    with open_engine(EngineConfig(), "build/policy/calc") as engine:           # TorchEngine here
        ...
    with open_engine(EngineConfig("vllm", workers=4, gpus_per_worker=1), ckpt, address=head):
        ...                                                                     # vLLM on Ray

In-process engines load the checkpoint on ``EngineConfig.device``, or take a policy already in
memory (the training loop's, after its update) instead of reading it back. Ray pools and vLLM
always load the checkpoint directory, which is what every replica reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from trace_core.policy.engine import Engine
from trace_core.policy.model import load_checkpoint, resolve_device
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.weights import node_checkpoint

if TYPE_CHECKING:
    from trace_core.rollout.placement import RunPlacement
    from trace_core.rollout.ray_pool import RayEnginePool


@contextlib.contextmanager
def open_engine(
    config: EngineConfig,
    checkpoint: str | Path,
    model: PreTrainedModel | None = None,
    address: str | None = None,
    name: str = "",
    serving: str = "",
    placement: RunPlacement | None = None,
) -> Iterator[Engine]:
    """The engine ``config`` names, for the block; what it started is stopped after it.

    ``address``: the Ray head of a pool (``workers >= 1``); None starts Ray in this process,
    unless it is already connected (a Ray job's driver). ``name``, with ``config.keep_alive_s``:
    the pool's actors are the run's kept ones (``rollout.ray_pool``), left running after it;
    ``serving``: the sync label they hold (``RayEnginePool``); ``placement``: the run's group,
    whose engine bundles the pool's actors take (``rollout.placement``)."""
    if config.workers:
        from trace_core.rollout.ray_pool import RayEnginePool

        with RayEnginePool(
            checkpoint,
            workers=config.workers,
            address=address,
            num_gpus_per_worker=config.gpus_per_worker,
            threads_per_worker=config.threads_per_worker,
            engine=config.engine,  # type: ignore[arg-type]  # checked by EngineConfig
            tensor_parallel=config.tensor_parallel,
            memory_fraction=config.vllm_memory_fraction(),
            max_rows=config.max_rows,
            cache_tokens=config.cache_tokens,
            eager=config.eager,
            dtype=config.dtype,
            name=name,
            keep_alive_s=config.keep_alive_s,
            serving=serving,
            placement=placement,
            driver=config.pool_driver,  # type: ignore[arg-type]  # checked by EngineConfig
            ready_timeout_s=config.ready_timeout_s,
            call_timeout_s=config.call_timeout_s,
            **config.vllm_kwargs(),
        ) as pool:
            yield pool
        return
    device = resolve_device(config.device)
    match config.engine:
        case "vllm":
            from trace_core.policy.vllm_engine import VLLMEngine, VLLMOptions

            vllm = config.vllm_kwargs()
            with VLLMEngine(
                str(node_checkpoint(checkpoint)),
                dtype=config.dtype,
                gpu_memory_utilization=config.vllm_memory_fraction(),
                tensor_parallel_size=config.tensor_parallel,
                max_model_len=vllm["max_model_len"],
                options=VLLMOptions(
                    enforce_eager=config.eager,
                    kv_cache_memory_bytes=vllm["kv_cache_bytes"],
                    max_num_seqs=vllm["max_num_seqs"],
                    max_num_batched_tokens=vllm["max_num_batched_tokens"],
                ),
            ) as engine:
                yield engine
        case "hf":
            from trace_core.policy.hf_engine import HFGenerateEngine

            yield HFGenerateEngine(model or load_checkpoint(checkpoint, device)[0])
        case _:
            from trace_core.policy.torch_engine import TorchEngine

            engine = TorchEngine(
                model or load_checkpoint(checkpoint, device)[0],
                device=device,
                max_batch=config.max_rows,
                cache_tokens=config.cache_tokens,
                replicas=0,  # on a CPU: one per torch thread (policy.replicas)
            )
            try:
                yield engine
            finally:
                engine.close()


class EngineSession:
    """The engine of a run, kept across its rollouts: started by the first, then each later
    checkpoint goes into the running engine (``update_weights``, vLLM's in-place reload)
    instead of a restart.

        with EngineSession(EngineConfig("vllm", workers=2), address) as session:
            for i in iterations:
                with session.engine(policy_dir) as engine:   # starts once, then reloads
                    trees = grow_trees(engine, ...)

    Only engines that are costly to start are kept: Ray pools and vLLM. An in-process torch or
    HF engine is built for each block around the policy already in memory (``model``).
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        name: str = "",
        placement: RunPlacement | None = None,
    ) -> None:
        """``name``, with ``config.keep_alive_s``: the run's kept engine actors, found again by
        every step of the run (``open_engine``); ``placement``: the run's group, reserved with
        its trainers' devices (``rollout.placement``)."""
        self.config, self.address, self.name = config, address, name
        self.placement = placement
        self._stack = contextlib.ExitStack()
        self._kept: Engine | None = None
        self._checkpoint = ""
        self.reloads = 0
        self.reload_seconds = 0.0
        """Wall seconds spent putting new checkpoints into the kept engine."""
        self.syncs = 0
        self.sync_seconds = 0.0

    @property
    def keeps(self) -> bool:
        return bool(self.config.workers) or self.config.engine == "vllm"

    @property
    def pool(self) -> RayEnginePool | None:
        """The kept engine when it is a pool of Ray actors (started by the first block)."""
        if self.config.workers and self._kept is not None:
            return self._kept  # type: ignore[return-value]
        return None

    def synced(self, label: str, seconds: float) -> None:
        """The kept engine got new weights by a sync (``train.trainer_group``): blocks for
        ``label`` use it as it is."""
        self._checkpoint = label
        self.syncs += 1
        self.sync_seconds += seconds

    @contextlib.contextmanager
    def engine(
        self, checkpoint: str | Path, model: PreTrainedModel | None = None
    ) -> Iterator[Engine]:
        if not self.keeps:
            with open_engine(self.config, checkpoint, model, self.address) as engine:
                yield engine
            return
        if self._kept is None:
            self._kept = self._stack.enter_context(
                open_engine(
                    self.config,
                    checkpoint,
                    address=self.address,
                    name=self.name,
                    placement=self.placement,
                )
            )
        elif str(checkpoint) != self._checkpoint:
            start = time.perf_counter()
            from trace_core.rollout.ray_pool import RayEnginePool

            if isinstance(self._kept, RayEnginePool):
                self._kept.update_weights(checkpoint)
            else:
                self._kept.reload(str(node_checkpoint(checkpoint)))  # type: ignore[attr-defined]
            self.reloads += 1
            self.reload_seconds += time.perf_counter() - start
        self._checkpoint = str(checkpoint)
        yield self._kept

    def attach(self, boot: str, label: str) -> bool:
        """Start the kept engine, or find the run's kept actors (``name``): new actors load
        ``boot``; True when every actor already holds the sync ``label`` (else the caller
        syncs them)."""
        if self._kept is None:
            self._kept = self._stack.enter_context(
                open_engine(
                    self.config,
                    boot,
                    address=self.address,
                    name=self.name,
                    serving=label,
                    placement=self.placement,
                )
            )
            self._checkpoint = str(getattr(self._kept, "checkpoint", boot))
        return self._checkpoint == label

    def close(self) -> None:
        """Stop the kept engine (idempotent)."""
        self._kept = None
        self._stack.close()

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
