"""Weights broadcast from a trainer process into engines in other processes (gloo, loopback):
the engines end up serving exactly what an engine built from the trainer's model serves, in
buckets far smaller than the model. The engines are ``sync_worker.py`` processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import sync_worker

from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.weight_sync import (
    IpcGroup,
    WeightPlan,
    choose_backend,
    device_id,
    open_store,
    send_weights,
    staging_device,
    sync_group,
    weight_plan,
)

WORKER = Path(sync_worker.__file__)


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_engines_in_other_processes_serve_the_trainers_weights_after_a_broadcast(
    kind: str, tmp_path: Path
) -> None:
    model = sync_worker.trained()
    plan = weight_plan(model, torch.float32, sync_worker.BUCKET_BYTES)
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    assert len(plan.buckets) > 3 and max(b.numel * 4 for b in plan.buckets) < 2 * layer
    size = 3
    store = open_store("127.0.0.1", size)
    outs = [tmp_path / f"engine-{r}.json" for r in range(1, size)]
    engines = [
        subprocess.Popen(
            [sys.executable, str(WORKER), kind, str(store.port), str(r), str(size), str(out)]
        )
        for r, out in zip(range(1, size), outs, strict=True)
    ]
    try:
        group = sync_group("127.0.0.1", store.port, 0, size, store=store, timeout_s=120)
        sent = send_weights(model, plan, group)
    finally:
        codes = [p.wait(timeout=120) for p in engines]
    assert codes == [0, 0]
    assert sent == plan.nbytes == sum(p.numel() for p in model.parameters()) * 4
    expected = sync_worker.samples(sync_worker.engine_of(kind, model))
    old = sync_worker.samples(sync_worker.engine_of(kind, create_policy(
        sync_worker.TOK, sync_worker.CONFIG, seed=1)))  # fmt: skip
    assert old != expected  # the test can tell the weights apart
    for out in outs:
        result = json.loads(out.read_text())
        assert result["received"] == plan.nbytes
        assert result["samples"] == expected


def test_a_sink_refuses_weights_of_another_shape() -> None:
    engine = TorchEngine(create_policy(sync_worker.TOK, sync_worker.CONFIG, seed=1))
    other = create_policy(sync_worker.TOK, TinyPolicyConfig(num_layers=2), seed=1)
    with pytest.raises(ValueError, match="not a whole decoder"):
        engine.weight_sink().begin(weight_plan(other, torch.float32).names[:-1])
    with pytest.raises(ValueError, match=r"cannot sync weights in torch\.int8"):
        weight_plan(other, torch.int8)


def test_a_plan_crosses_into_vllms_workers_as_plain_json() -> None:
    """vLLM's workers get the plan as JSON values (``policy.vllm_worker.receive_policy``)."""
    model = create_policy(sync_worker.TOK, sync_worker.CONFIG, seed=1)
    plan = weight_plan(model, torch.bfloat16, bucket_bytes=2**12)
    data = json.loads(json.dumps(plan.to_json()))
    assert WeightPlan.from_json(data) == plan and len(plan.buckets) > 1


def test_the_backend_follows_where_the_members_are() -> None:
    assert device_id("cpu") is None
    assert choose_backend([None, None, None]) == "gloo"
    assert choose_backend(["GPU-a", "GPU-b", "GPU-c"]) == "nccl"  # a GPU each
    assert choose_backend(["GPU-a", "GPU-a"]) == "cuda-ipc"  # NCCL refuses a shared device
    assert choose_backend(["GPU-a", "GPU-a", "GPU-b"]) == "gloo"  # neither fits every member
    assert choose_backend(["GPU-a", None]) == "gloo"  # an engine on a CPU
    assert staging_device("gloo", "cuda") == "cpu"
    assert staging_device("nccl", "cuda") == staging_device("cuda-ipc", "cuda") == "cuda"


def test_a_sync_group_names_the_backends_it_has() -> None:
    with pytest.raises(ValueError, match="gloo, nccl, cuda-ipc, got 'mpi'"):
        sync_group("127.0.0.1", 1, 0, 1, "mpi")
    with pytest.raises(ValueError, match="contiguous CUDA tensors only"):
        IpcGroup(control=None, rank=0).broadcast(torch.zeros(4), 0)
