"""``bench handoff`` on the tiny policy, the session's SeaweedFS and an in-process Ray: the
resident mode moves trees, predictor and metrics through S3 (and one checkpoint at the end),
the S3 mode the policy and its optimizer state every iteration, and each says so in its own
byte counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_core.bench.handoff import HandoffBenchConfig, run_handoff_bench
from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_handoff_counts_what_each_design_moves(seaweed, s3_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    policy = create_policy(tokenizer, TinyPolicyConfig(), seed=0)
    save_checkpoint(policy, tokenizer, tmp_path / "policy")
    config = HandoffBenchConfig(tmp_path / "policy", iterations=2, budget=4, max_tokens=8)
    result = run_handoff_bench(config, server=seaweed)
    weights = sum(p.numel() for p in policy.parameters()) * 4
    assert result.policy_bytes == weights
    resident, s3 = result.modes["resident"], result.modes["s3"]
    assert [(f.iteration, f.checkpoint) for f in resident] == [(1, False), (2, True)]
    assert [(f.iteration, f.checkpoint) for f in s3] == [(1, True), (2, True)]
    # Trees, predictor and metrics only; the tiny policy is smaller than the hashed predictor.
    trees_and_predictor = resident[0].s3_bytes
    assert 0 < trees_and_predictor < weights
    # The checkpoint: policy and AdamW's two moments (fp32 policy: no master weights).
    assert resident[1].s3_bytes >= trees_and_predictor + 3 * weights
    # S3 mode, iteration 2: the trainer reads policy and optimizer, writes both, the engine
    # reads the policy: 7 policies' bytes at least, besides trees and predictor.
    assert s3[1].s3_bytes >= 7 * weights
    assert all(f.sync_seconds > 0 and f.iteration_seconds > 0 for f in resident + s3)
    data = json.loads(json.dumps(result.as_dict()))
    assert set(data["ratios"]) == {"s3_share", "sync_speedup", "iteration_speedup"}
