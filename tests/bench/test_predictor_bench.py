"""``trace-rl bench predictor`` and ``trace-rl predictor fit`` on small hand-built Parquet trees.

The commands run in process through typer's runner (no subprocess start-up); the quality of the
predictor itself is tested in ``tests/policy/test_predictor.py``, here only what the commands read
and write.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.bench.predictor import (
    REFERENCE,
    PredictorBenchConfig,
    split_by_prompt,
    tree_paths,
)
from trace_core.cli import app
from trace_core.policy.predictor import CONFIG_FILE, PredictorConfig, SharedPredictor
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.store.schema import write_trees

TURN = 3  # <|im_end|> in the word tokenizer
EASY, HARD = 8, 9  # prompt markers: success probability 0.8 / 0.2


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def tiny_tree(prompt_id: str, rng: np.random.Generator, tree_id: int = 0) -> RolloutTree:
    """Two rollouts of two turns; whether the prompt is easy is visible in its tokens."""
    easy = bool(rng.random() < 0.5)
    prompt = [*rng.integers(20, 60, size=6), EASY if easy else HARD, TURN]
    builder = TreeBuilder(TreeInfo(prompt_id=prompt_id, tree_id=tree_id), prompt_tokens=prompt)
    for _ in range(2):
        first = builder.add_turn(0, [*rng.integers(20, 60, size=3), TURN], [21, TURN])
        last = builder.add_turn(first, [*rng.integers(20, 60, size=3), TURN])
        builder.set_reward(last, float(rng.random() < (0.8 if easy else 0.2)))
    return builder.build()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Parquet files of trees (prompt ids repeat across them) and a policy tokenizer."""
    root = tmp_path_factory.mktemp("predictor")
    rng = np.random.default_rng(0)
    (root / "trees").mkdir()
    for part in range(2):
        trees = [tiny_tree(f"p{(part * 60 + i) % 100}", rng, i) for i in range(80)]
        write_trees(root / "trees" / f"trees-{part}.parquet", trees)
    build_word_tokenizer(["x"]).save_pretrained(root / "policy")
    return root


def test_split_by_prompt_keeps_a_prompt_on_one_side() -> None:
    rng = np.random.default_rng(1)
    trees = [tiny_tree(f"p{i % 10}", rng) for i in range(30)]
    train, held = split_by_prompt(trees, 0.3, np.random.default_rng(0))
    train_ids, held_ids = {t.info.prompt_id for t in train}, {t.info.prompt_id for t in held}
    assert len(held_ids) == 3 and not train_ids & held_ids
    assert len(train) + len(held) == 30


def test_tree_paths_and_config_errors(workspace: Path) -> None:
    files = tree_paths(str(workspace / "trees"))
    assert [p.name for p in files] == ["trees-0.parquet", "trees-1.parquet"]
    assert tree_paths(str(workspace / "trees" / "*-1.parquet")) == files[1:]
    with pytest.raises(ValueError, match="no Parquet files"):
        tree_paths(str(workspace / "nothing-*.parquet"))
    settings = PredictorConfig(turn_token=TURN)
    with pytest.raises(ValueError, match="featurizer"):
        PredictorBenchConfig(files, settings, featurizers=("bert",))
    with pytest.raises(ValueError, match="heldout"):
        PredictorBenchConfig(files, settings, heldout=1.0)


@pytest.mark.slow
def test_bench_predictor_command_writes_json(workspace: Path) -> None:
    out = workspace / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "predictor",
            "--trees",
            str(workspace / "trees"),
            "--checkpoint",
            str(workspace / "policy"),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "unseen prefixes" in result.output
    data = json.loads(out.read_text())
    assert set(data) == {"config", "data", "predictors"}
    assert data["data"]["trees"] == 160 and data["data"]["prompts"] == 100
    assert data["data"]["train_trees"] + data["data"]["heldout_trees"] == 160
    assert set(data["predictors"]) == {"hashed", REFERENCE}
    for run in data["predictors"].values():
        for kind in ("roots", "prefixes"):
            scores = run[kind]
            assert scores["nodes"] > 0 and scores["pairs"] >= scores["nodes"]
            for key in ("brier", "brier_constant", "auc", "brier_skill"):
                assert math.isfinite(scores[key]), (kind, key)
            assert scores["auc_constant"] == 0.5
    # The prompt marker is all there is to learn: held-out roots are forecast better than
    # by the constant (50 held-out roots × 2 leaves is a small sample, hence no tighter bound).
    assert data["predictors"]["hashed"]["roots"]["brier_skill"] > 0


def test_predictor_fit_command_saves_and_resumes(workspace: Path) -> None:
    out, more = workspace / "predictor", workspace / "predictor-2"
    args = ["--checkpoint", str(workspace / "policy"), "--epochs", "2"]
    trees = str(workspace / "trees" / "trees-0.parquet")
    missing = ["--checkpoint", str(workspace / "no-policy")]
    failed = CliRunner().invoke(
        app, ["predictor", "fit", "--trees", trees, "--output", str(out), *missing]
    )
    assert (
        failed.exit_code == 2
        and "--checkpoint " in failed.output
        and "no-policy does not exist" in failed.output
    )
    first = CliRunner().invoke(
        app, ["predictor", "fit", "--trees", trees, "--output", str(out), *args]
    )
    assert first.exit_code == 0, first.output
    assert json.loads((out / CONFIG_FILE).read_text())["fits"] == 1
    second = CliRunner().invoke(
        app,
        ["predictor", "fit", "--trees", trees, "--output", str(more), "--resume", str(out), *args],
    )
    assert second.exit_code == 0, second.output
    assert "replayed" in second.output
    predictor = SharedPredictor.load(more)
    assert predictor.fits == 2 and predictor.replay_rows > 0
