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
from collections.abc import Iterator
from pathlib import Path

from transformers import PreTrainedModel

from trace_core.policy.engine import Engine
from trace_core.policy.model import load_checkpoint, resolve_device
from trace_core.rollout.engine_config import EngineConfig


@contextlib.contextmanager
def open_engine(
    config: EngineConfig,
    checkpoint: str | Path,
    model: PreTrainedModel | None = None,
    address: str | None = None,
) -> Iterator[Engine]:
    """The engine ``config`` names, for the block; what it started is stopped after it.

    ``address``: the Ray head of a pool (``workers >= 1``); None starts Ray in this process,
    unless it is already connected (a Ray job's driver)."""
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
            memory_fraction=config.memory_fraction,
            max_rows=config.max_rows,
            cache_tokens=config.cache_tokens,
        ) as pool:
            yield pool
        return
    device = resolve_device(config.device)
    match config.engine:
        case "vllm":
            from trace_core.policy.vllm_engine import VLLMEngine

            with VLLMEngine(
                str(checkpoint),
                gpu_memory_utilization=config.memory_fraction,
                tensor_parallel_size=config.tensor_parallel,
            ) as engine:
                yield engine
        case "hf":
            from trace_core.policy.hf_engine import HFGenerateEngine

            yield HFGenerateEngine(model or load_checkpoint(checkpoint, device)[0])
        case _:
            from trace_core.policy.torch_engine import TorchEngine

            yield TorchEngine(
                model or load_checkpoint(checkpoint, device)[0],
                device=device,
                max_batch=config.max_rows,
                cache_tokens=config.cache_tokens,
            )
