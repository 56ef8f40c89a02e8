"""Tensor-parallel engines on a Ray head that advertises GPUs (``ray start --num-gpus 4``: Ray
schedules by the count, without devices): each engine's GPUs are reserved on one node by a
placement group the way vLLM uses it, and a size beyond a pod's GPUs is refused before any
work."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import ray

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.ray_pool import (
    EngineStartError,
    RayEnginePool,
    in_group,
    ray_session,
    tensor_parallel_group,
)
from trace_core.rollout.ray_worker import (
    CPU_KV_MAX,
    CPU_KV_SHARE,
    WorkerSpec,
    cpu_kv_cache_bytes,
)

GIB = 2**30


@pytest.fixture(scope="module")
def gpu_head(start_ray_head: Callable[..., AbstractContextManager[Any]]) -> Iterator[Any]:
    with start_ray_head(num_gpus=4) as head:
        yield head


@ray.remote(num_gpus=1, num_cpus=0)
def device_ids() -> tuple[str, list[str]]:
    """What one of vLLM's Ray workers gets from its bundle: its node and GPU ids."""
    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


@ray.remote(num_cpus=1, num_gpus=0)
class Driver:
    """An actor placed as the pool places an engine actor (bundle 0, no GPU of its own), which
    starts one GPU task per bundle as vLLM's executor does."""

    def spread(self, workers: int) -> list[tuple[str, list[str]]]:
        group = ray.util.get_current_placement_group()
        assert group is not None
        return ray.get([device_ids.remote() for _ in range(workers)])

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.mark.slow
@pytest.mark.cluster
def test_a_tensor_parallel_engine_reserves_its_gpus_on_one_node(gpu_head: Any) -> None:
    with ray_session(gpu_head.address):
        group = tensor_parallel_group(2, threads=1, detached=False)
        try:
            assert group.wait(timeout_seconds=60)
            # vLLM's rule for a group it runs in: no bundle of more than one GPU, and as many
            # GPU bundles as its tensor-parallel size.
            assert [b.get("GPU") for b in group.bundle_specs] == [1.0, 1.0]
            driver = Driver.options(scheduling_strategy=in_group(group)).remote()  # type: ignore[attr-defined]
            placed = ray.get(driver.spread.remote(2), timeout=60)
            assert len({node for node, _ in placed}) == 1  # one node
            assert sorted(len(ids) for _, ids in placed) == [1, 1]
            assert len({ids[0] for _, ids in placed}) == 2  # two different GPUs
            assert ray.available_resources().get("GPU", 0) == 2  # the group holds two of four
            ray.kill(driver)
        finally:
            ray.util.remove_placement_group(group)


@pytest.mark.slow
@pytest.mark.cluster
def test_a_second_engine_waits_for_gpus_rather_than_sharing_them(gpu_head: Any) -> None:
    with ray_session(gpu_head.address):
        groups = [tensor_parallel_group(2, threads=1, detached=False) for _ in range(3)]
        try:
            ready = [g.wait(timeout_seconds=20) for g in groups]
            assert ready == [True, True, False]  # 4 GPUs: two engines of two, the third waits
        finally:
            for group in groups:
                ray.util.remove_placement_group(group)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM would start")
def test_the_pool_places_a_tensor_parallel_engine_and_says_why_it_did_not_start(
    gpu_head: Any, tmp_path: Path
) -> None:
    """The pool's own path: the engine actor lands in its group (here it then fails, as vLLM is
    not installed in this environment), the failure comes back as one line naming the worker and
    the cause, and the group's GPUs are given back."""
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, tmp_path)
    with ray_session(gpu_head.address):
        with pytest.raises(EngineStartError) as failed:
            RayEnginePool(
                tmp_path, workers=1, engine="vllm", tensor_parallel=2, num_gpus_per_worker=1,
                max_restarts=0, ready_timeout_s=120,
            )  # fmt: skip
        message = str(failed.value)
        assert message.startswith("engine worker 0 did not start: ImportError: VLLMEngine needs")
        assert "\n" not in message and "Traceback" not in message
        deadline = time.monotonic() + 60  # the group's removal is asynchronous
        while ray.available_resources().get("GPU", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("GPU", 0) == 4  # the group is gone


def test_tensor_parallel_beyond_a_pods_gpus_is_refused_before_any_work() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel 16 needs 16 GPUs.*has 8 \(gpus_per_node\)"
    ):
        EngineConfig("vllm", workers=1, gpus_per_worker=1, tensor_parallel=16)
    EngineConfig("vllm", workers=1, gpus_per_worker=1, tensor_parallel=16, gpus_per_node=16)
    with pytest.raises(ValueError, match="gpus_per_worker must be 0 or >= 1"):
        EngineConfig("vllm", workers=2, gpus_per_worker=0.5, tensor_parallel=2)


def test_engines_sharing_a_gpu_split_its_memory() -> None:
    assert EngineConfig("vllm", workers=2, gpus_per_worker=0.5).vllm_memory_fraction() == 0.45
    assert EngineConfig("vllm", workers=2, gpus_per_worker=1).vllm_memory_fraction() == 0.9
    explicit = EngineConfig("vllm", workers=2, gpus_per_worker=0.5, memory_fraction=0.8)
    assert explicit.vllm_memory_fraction() == 0.8  # a setting wins


def test_cpu_engines_split_the_free_memory_of_their_node() -> None:
    spec = WorkerSpec(engine="vllm", threads=1, pool_workers=2)
    assert cpu_kv_cache_bytes(spec, 20 * GIB, node_cpus=2) == int(20 * GIB * CPU_KV_SHARE / 2)
    # Four engines, but a 2-CPU node holds only two of them.
    wide = WorkerSpec(engine="vllm", threads=1, pool_workers=4)
    assert cpu_kv_cache_bytes(wide, 20 * GIB, node_cpus=2) == int(20 * GIB * CPU_KV_SHARE / 2)
    assert cpu_kv_cache_bytes(spec, 20 * GIB, node_cpus=16) == int(20 * GIB * CPU_KV_SHARE / 2)
    alone = WorkerSpec(engine="vllm", threads=1, pool_workers=1)
    assert cpu_kv_cache_bytes(alone, 200 * GIB, node_cpus=64) == CPU_KV_MAX
