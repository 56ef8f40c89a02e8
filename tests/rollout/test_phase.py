"""One rollout path: the engine factory builds what ``EngineConfig`` names, and ``run_rollout``
is what the CLI, the loop and the pipeline's rollout step all reach — with an in-process engine
and with a Ray pool chosen by a config value alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trace_core.algo.plan import Budget
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.hf_engine import HFGenerateEngine
from trace_core.policy.model import create_policy, load_checkpoint, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.engines import open_engine
from trace_core.rollout.grow import GrowConfig
from trace_core.rollout.phase import run_rollout
from trace_core.rollout.predictor import ConstantPredictor

SUITE = CalcSuite(seed=0, train_size=24, eval_size=4)
# 6 roots × (1 + 2/2) = 12 rollout units.
GROW = GrowConfig("trace", Budget(6, 2), SamplingParams(max_tokens=8), seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trace_core.policy.model import TinyPolicyConfig

    path = tmp_path_factory.mktemp("policy") / "policy"
    tokenizer = build_word_tokenizer(SUITE.vocabulary())
    small = TinyPolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    save_checkpoint(create_policy(tokenizer, small, seed=0), tokenizer, path)
    return path


@pytest.mark.parametrize(
    ("config", "kind"), [(EngineConfig(), TorchEngine), (EngineConfig("hf"), HFGenerateEngine)]
)
def test_the_factory_builds_the_engine_the_config_names(
    checkpoint: Path, config: EngineConfig, kind: type
) -> None:
    with open_engine(config, checkpoint) as engine:
        assert type(engine) is kind


def test_an_engine_takes_the_policy_in_memory_instead_of_reading_it(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint)
    with torch.no_grad():
        model.lm_head.weight.mul_(0)  # tied: the embeddings too; a reload would not be zero
    with open_engine(EngineConfig(), checkpoint, model=model) as engine:
        assert isinstance(engine, TorchEngine)
        assert not engine.weights.embed.any()


@pytest.mark.slow
def test_run_rollout_spends_the_budget_and_measures_it(checkpoint: Path) -> None:
    pool = SUITE.tasks("train")
    result = run_rollout(checkpoint, pool, SUITE.make_env, None, GROW, EngineConfig())
    assert result.metrics.units == pytest.approx(12.0)
    assert sum(t.units for t in result.trees) == pytest.approx(12.0)
    assert result.metrics.tokens == sum(t.generated_tokens for t in result.trees)
    # The same call again: the in-process engine is deterministic for a fixed seed.
    again = run_rollout(checkpoint, pool, SUITE.make_env, ConstantPredictor(), GROW, EngineConfig())
    assert all(a.equals(b) for a, b in zip(again.trees, result.trees, strict=True))


@pytest.mark.slow
def test_a_config_value_moves_the_rollout_onto_ray_workers(checkpoint: Path) -> None:
    """``EngineConfig(workers=1)``: the same phase through a Ray pool (Ray in this process)."""
    with open_engine(EngineConfig(workers=1), checkpoint) as engine:
        from trace_core.rollout.ray_pool import RayEnginePool

        assert isinstance(engine, RayEnginePool) and engine.workers == 1
    pool = SUITE.tasks("train")
    result = run_rollout(checkpoint, pool, SUITE.make_env, None, GROW, EngineConfig(workers=1))
    assert result.metrics.units == pytest.approx(12.0)
    assert {t.info.strategy for t in result.trees} == {"trace"}


def test_engine_config_names_the_field_it_refuses() -> None:
    with pytest.raises(ValueError, match="engine must be one of torch, hf, vllm"):
        EngineConfig("tgi")
    with pytest.raises(ValueError, match="gpus_per_worker needs workers"):
        EngineConfig(gpus_per_worker=1)
    with pytest.raises(ValueError, match="memory_fraction"):
        EngineConfig("vllm", memory_fraction=1.5)
    with pytest.raises(ValueError, match="keep_alive_s needs workers"):
        EngineConfig(keep_alive_s=600)
    with pytest.raises(ValueError, match="keep_alive_s must be >= 0"):
        EngineConfig(workers=1, keep_alive_s=-1)
