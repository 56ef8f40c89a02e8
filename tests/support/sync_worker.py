"""An engine process for ``test_weight_sync.py``: built on the starting weights (seed 1), it
joins the sync group, takes the broadcast, and writes its seeded samples as JSON.

    python sync_worker.py KIND PORT RANK SIZE OUT.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from trace_core.policy.engine import SamplingParams
from trace_core.policy.hf_engine import HFGenerateEngine
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.weight_sync import ModuleSink, apply_weights, sync_group, weight_plan

TOK = build_word_tokenizer(["the quick brown fox jumps over the lazy dog", "12 + 30 = 42"])
CONFIG = TinyPolicyConfig(num_layers=3, num_kv_heads=2)
PROMPTS = [[1, 5, 7, 9], [1, 4, 4]]
PARAMS = SamplingParams(n=3, max_tokens=6)
BUCKET_BYTES = 40_000


def trained() -> Any:
    """The trainer's weights: not the engines', with peaked distributions."""
    model = create_policy(TOK, CONFIG, seed=2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    return model


def engine_of(kind: str, model: Any) -> Any:
    return TorchEngine(model, cache_tokens=512) if kind == "torch" else HFGenerateEngine(model)


def samples(engine: Any) -> list[list[list[int]]]:
    return [[c.token_ids.tolist() for c in row] for row in engine.generate(PROMPTS, PARAMS, 3)]


def main(kind: str, port: int, rank: int, size: int, out: str) -> None:
    torch.set_num_threads(1)
    engine = engine_of(kind, create_policy(TOK, CONFIG, seed=1))
    samples(engine)  # fills the prefix cache with the old weights
    plan = weight_plan(trained(), torch.float32, BUCKET_BYTES)
    group = sync_group("127.0.0.1", port, rank, size)
    sink = engine.weight_sink() if kind == "torch" else ModuleSink(engine.model)
    received = apply_weights(plan, group, sink)
    with open(out, "w") as f:
        json.dump({"received": received, "samples": samples(engine)}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
