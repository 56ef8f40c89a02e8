"""``trace-rl model import`` and ``trace-rl model check`` on SmolLM2-135M-Instruct, and the model
commands docs/models.md prints, run exactly as printed (from the repository root, where they
write build/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.models import IMPORT_COMMAND, smollm2_dir

from trace_core.envs.calc import CalcSuite
from trace_core.policy.importer import gguf_identity, import_gguf, imported_from
from trace_core.train.model_check import check_model

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PAGE = (ROOT / "docs" / "models.md").read_text()  # where the commands are printed
CHECK = (
    "trace-rl model check build/models/smollm2 --task calc --max-tokens 64 "
    "--json build/model-check.json"
)
BENCH = (
    "trace-rl bench update --checkpoint build/models/smollm2 --budgets 0,1024,256 "
    "--json build/bench-update.json"
)

ENGINES = (
    "trace-rl bench engine --checkpoint build/models/smollm2 --batch 4 --new-tokens 16 "
    "--threads 2 --json build/bench-engine-smollm2.json"
)


def run(command: str) -> subprocess.CompletedProcess[str]:
    name, *args = command.split()
    return subprocess.run(
        [str(BIN / name), *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


@pytest.mark.slow
def test_import_writes_a_checkpoint_the_loop_loads() -> None:
    assert IMPORT_COMMAND in PAGE  # the cache is filled by running it as printed
    folder = smollm2_dir()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    # It records the GGUF it came from, by content: a cache of it is checked against that.
    record = imported_from(folder)
    assert record == gguf_identity("smollm2") and record["file"].endswith(".gguf")


def test_import_refuses_an_existing_folder_and_unknown_sources(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        import_gguf("smollm2", tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="built-in models"):
        import_gguf("llama-70b", tmp_path / "new")
    with pytest.raises(FileNotFoundError, match="no such file"):
        import_gguf(str(tmp_path / "missing.gguf"), tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_readme_model_check_is_exact_and_the_logprobs_agree() -> None:
    smollm2_dir()
    assert CHECK in PAGE
    done = run(CHECK)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((ROOT / "build" / "model-check.json").read_text())
    assert report["template_exact"] is True and report["conversations"] == 16
    assert report["stop_ids"] == [2] and report["stop_tokens"] == ["<|im_end|>"]
    assert report["samples"] == 64 and 0 <= report["action_parse_rate"] <= 1
    assert report["logprob_gap"] < 1e-3  # fp32 on CPU
    assert report["parameters"] == 134_515_008 and report["dtype"] == "float32"
    assert report["memory_gib"]["total"] > 16 * 134_515_008 / 2**30


@pytest.mark.slow
def test_readme_bench_update_follows_the_budget() -> None:
    smollm2_dir()
    assert BENCH in PAGE
    done = run(BENCH)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((ROOT / "build" / "bench-update.json").read_text())["rows"]
    assert [r["budget"] for r in rows] == [0, 1024, 256]
    assert rows[2]["update_gib"] < rows[1]["update_gib"] < rows[0]["update_gib"]


@pytest.mark.slow
def test_readme_bench_engine_times_smollm2() -> None:
    smollm2_dir()
    assert ENGINES in PAGE
    done = run(ENGINES)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((ROOT / "build" / "bench-engine-smollm2.json").read_text())
    assert data["batch"] == 4 and data["new_tokens"] == 16
    for key in ("torch_tokens_per_s", "hf_tokens_per_s", "floor_seconds", "prefill_tokens"):
        assert data[key] > 0, key
    # The median of the repeats' paired ratios, within their spread.
    assert data["ratio_vs_hf_min"] <= data["ratio_vs_hf"] <= data["ratio_vs_hf_max"]
    assert "smollm2, batch 4 × 16 new tokens" in " ".join(done.stdout.split())


def test_model_check_on_the_word_tokenizer_policy(tmp_path: Path) -> None:
    """The tiny policy passes the same check with its own template."""
    from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
    from trace_core.policy.tokenizer import build_word_tokenizer

    suite = CalcSuite(train_size=40, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, tmp_path)
    report = check_model(tmp_path, suite, samples=8, max_tokens=8, micro_tokens=512)
    assert report.template == "word" and report.template_exact and report.stop_ids == [3]
    assert report.logprob_gap < 1e-4 and report.samples == 8
