"""Weights broadcast from a trainer process into engines in other processes (gloo, loopback):
the engines end up serving exactly what an engine built from the trainer's model serves, in
buckets far smaller than the model."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from trace_core.policy.engine import SamplingParams
from trace_core.policy.hf_engine import HFGenerateEngine
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.weight_sync import (
    ModuleSink,
    apply_weights,
    open_store,
    send_weights,
    sync_group,
    weight_plan,
)

TOK = build_word_tokenizer(["the quick brown fox jumps over the lazy dog", "12 + 30 = 42"])
CONFIG = TinyPolicyConfig(num_layers=3, num_kv_heads=2)
PROMPTS = [[1, 5, 7, 9], [1, 4, 4]]
PARAMS = SamplingParams(n=3, max_tokens=6)


def _engine_process(kind: str, port: int, rank: int, size: int, plan: Any, out: Any) -> None:
    """An engine on the starting weights (seed 1), then the sync, then a seeded generate."""
    torch.set_num_threads(1)
    model = create_policy(TOK, CONFIG, seed=1)
    engine: Any = TorchEngine(model, cache_tokens=512) if kind == "torch" else None
    if engine is None:
        engine = HFGenerateEngine(model)
    engine.generate(PROMPTS, PARAMS, seed=3)  # fills the prefix cache with the old weights
    group = sync_group("127.0.0.1", port, rank, size)
    sink = engine.weight_sink() if kind == "torch" else ModuleSink(engine.model)
    received = apply_weights(plan, group, sink)
    completions = engine.generate(PROMPTS, PARAMS, seed=3)
    out.put((rank, received, [[c.token_ids.tolist() for c in row] for row in completions]))


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_engines_in_other_processes_serve_the_trainers_weights_after_a_broadcast(kind):
    trained = create_policy(TOK, CONFIG, seed=2)  # the trainer's weights: not the engines'
    with torch.no_grad():
        for p in trained.parameters():  # peaked distributions: samples tell weights apart
            if p.dim() == 2:
                p.mul_(20)
    plan = weight_plan(trained, torch.float32, bucket_bytes=40_000)
    layer = sum(p.numel() for p in trained.model.layers[0].parameters()) * 4
    assert len(plan.buckets) > 3 and max(b.numel * 4 for b in plan.buckets) < 2 * layer
    context = mp.get_context("spawn")
    out = context.Queue()
    size = 3
    store = open_store("127.0.0.1", size)
    engines = [
        context.Process(target=_engine_process, args=(kind, store.port, r, size, plan, out))
        for r in range(1, size)
    ]
    for p in engines:
        p.start()
    try:
        group = sync_group("127.0.0.1", store.port, 0, size, store=store)
        sent = send_weights(trained, plan, group)
        results = sorted(out.get(timeout=120) for _ in engines)
    finally:
        for p in engines:
            p.join(timeout=60)
    assert sent == plan.nbytes == sum(p.numel() for p in trained.parameters()) * 4
    fresh: Any = TorchEngine(trained, cache_tokens=512) if kind == "torch" else None
    fresh = fresh or HFGenerateEngine(trained)
    expected = [[c.token_ids.tolist() for c in row] for row in fresh.generate(PROMPTS, PARAMS, 3)]
    stale = create_policy(TOK, CONFIG, seed=1)
    before: Any = TorchEngine(stale, cache_tokens=512) if kind == "torch" else None
    before = before or HFGenerateEngine(stale)
    old = [[c.token_ids.tolist() for c in row] for row in before.generate(PROMPTS, PARAMS, 3)]
    assert old != expected  # the test can tell the weights apart
    for rank, received, completions in results:
        assert received == plan.nbytes, rank
        assert completions == expected, rank


def test_a_sink_refuses_weights_of_another_shape():
    engine = TorchEngine(create_policy(TOK, CONFIG, seed=1), cache_tokens=64)
    other = create_policy(TOK, TinyPolicyConfig(num_layers=2), seed=1)
    with pytest.raises(ValueError, match="not a whole decoder"):
        engine.weight_sink().begin(weight_plan(other, torch.float32).names[:-1])
    with pytest.raises(ValueError, match=r"cannot sync weights in torch\.int8"):
        weight_plan(other, torch.int8)
