"""``trace-rl rollout --workers 2 --ray-address`` against a real Ray head on 127.0.0.1.

The head (``start_ray_head`` in tests/conftest.py) runs without the dashboard, token auth off
(loopback only), and is stopped by its pid with nothing of it left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.store.schema import read_trees

pytestmark = pytest.mark.cluster

BIN = Path(sys.executable).parent
ENV = dict(os.environ)  # the session's token and mode (tests/conftest.py)


@pytest.fixture
def ray_head(
    start_ray_head: Callable[..., AbstractContextManager[Any]],
) -> Iterator[tuple[str, Path]]:
    """(address, temp dir) of a Ray head (tests/conftest.py) that lives for the test."""
    with start_ray_head() as head:
        yield head.address, head.temp_dir


def test_rollout_with_two_workers_on_a_ray_head(ray_head: tuple[str, Path], tmp_path: Path) -> None:
    address, temp_dir = ray_head
    suite = CalcSuite()
    tokenizer = build_word_tokenizer(suite.vocabulary())
    checkpoint = tmp_path / "policy"
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, checkpoint)
    trees_path, metrics_path = tmp_path / "trees.parquet", tmp_path / "metrics.json"
    # 16 roots × (1 + 2/2) = 32 units.
    command = [
        str(BIN / "trace-rl"),
        "rollout",
        f"--checkpoint={checkpoint}",
        "--workers=2",
        f"--ray-address={address}",
        "--budget=16",
        "--continuations=2",
        "--prompts=16",
        "--max-tokens=12",
        f"--output={trees_path}",
        f"--metrics={metrics_path}",
    ]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engines: 2 Ray torch workers, continuous driver" in done.stdout  # the default

    trees = read_trees(trees_path)
    assert trees and sum(t.units for t in trees) == 32.0
    assert len({t.info.tree_id for t in trees}) == len(trees)
    for tree in trees:
        assert tree.info.strategy == "trace"
        assert not np.isnan(tree.reward[tree.leaf_mask]).any()
    metrics = json.loads(metrics_path.read_text())
    assert metrics["strategy"] == "trace" and metrics["units"] == 32.0
    assert metrics["tokens"] == sum(t.generated_tokens for t in trees) > 0
    # The engine actors ran on this head, not on a Ray started inside the command.
    logs = list(temp_dir.glob("session_*/logs/worker-*"))
    assert any("EngineWorker" in p.read_text(errors="replace") for p in logs)
