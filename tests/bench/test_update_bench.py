"""``trace-rl bench update``: the update's peak memory follows the micro-batch token budget.

A random Llama-shaped model wide enough that activations dominate the update (vocabulary
8,000, hidden 256, 4 layers: ≈8 MB of weights, ≈0.4 GB of unbatched activations for 16 paths
of 512 tokens), so the peaks differ by far more than allocator noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trace_core.bench.update import UpdateBenchConfig, run_update_bench
from trace_core.policy.memory import QWEN3, ModelShape, estimate_update
from trace_core.policy.model import save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "policy"
    config = LlamaConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    save_checkpoint(LlamaForCausalLM(config), build_word_tokenizer(["a b"]), path)
    return path


@pytest.mark.slow
def test_peak_follows_the_budget_not_the_minibatch(wide: Path) -> None:
    config = UpdateBenchConfig(str(wide), (0, 2048, 512), paths=16, prompt_tokens=256,
                               generated_tokens=256)  # fmt: skip
    whole, mid, small = run_update_bench(config)
    assert (whole.passes, mid.passes, small.passes) == (1, 4, 16)  # 8,192 tokens in all
    assert small.update_gib < mid.update_gib < whole.update_gib
    assert small.update_gib < 0.5 * whole.update_gib
    for row in (whole, mid, small):
        assert row.logprob_gap > 0  # the synthetic logprobs are not the model's: a real update
        assert 0.5 < row.estimate_gib / row.update_gib < 2, row  # the estimate is of the order


def test_estimate_counts_parameters_of_the_published_shapes() -> None:
    # Qwen3-8B: 36 layers of 4096·(2·4096 + 2·1024) + 3·4096·12288, untied 151,936 × 4096.
    assert QWEN3["8B"].parameters == pytest.approx(8.19e9, rel=0.01)
    assert QWEN3["1.7B"].parameters == pytest.approx(1.72e9, rel=0.01)
    assert QWEN3["14B"].parameters == pytest.approx(14.77e9, rel=0.01)
    shape = QWEN3["8B"]
    small = estimate_update(shape, 2048, checkpointing=True)
    assert small.weights + small.gradients + small.optimizer == 16 * shape.parameters
    assert small.cast == 2 * shape.parameters  # bf16 copies under autocast (CUDA)
    assert estimate_update(shape, 8192, False).activations > 4 * small.activations
    assert estimate_update(shape, 8192, True, device="cpu").cast == 0
    with pytest.raises(ValueError, match="micro_tokens"):
        estimate_update(shape, 0, True)


def test_shape_from_a_config_matches_the_model(wide: Path) -> None:
    from trace_core.policy.model import load_checkpoint

    model, _ = load_checkpoint(wide)
    assert ModelShape.from_config(model.config).parameters == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.slow
def test_cli_bench_update_writes_rows_and_estimates(wide: Path, tmp_path: Path) -> None:
    out = tmp_path / "update.json"
    done = subprocess.run(
        [str(BIN / "trace-rl"), "bench", "update", "--checkpoint", str(wide), "--budgets", "0,256",
         "--paths", "4", "--prompt-tokens", "64", "--generated-tokens", "64", "--json", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "vs unbatched" in done.stdout and "Qwen3-8B" in done.stdout
    data = json.loads(out.read_text())
    assert [r["budget"] for r in data["rows"]] == [0, 256]
    assert data["rows"][0]["update_ratio"] == 1.0
    assert set(data["estimates_gib"]["checkpointing"]) == {"1.7B", "8B", "14B"}
    bad = subprocess.run(
        [str(BIN / "trace-rl"), "bench", "update", "--checkpoint", str(wide), "--budgets", "x"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--budgets must be integers" in bad.stdout + bad.stderr
