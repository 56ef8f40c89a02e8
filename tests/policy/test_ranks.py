"""Data-parallel updates never hang, whatever the data: two ranks over gloo, FSDP and DDP, given
different numbers of paths of different lengths, with micro-batches, π_old recomputed and two
epochs, run the same number of passes in every phase (padding with zero-weight passes) and end
where one process ends on the same data."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import (
    TinyPolicyConfig,
    create_policy,
    load_checkpoint,
    save_checkpoint,
)
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import UpdateConfig, make_optimizer, pack, tree_paths, update_policy
from trace_core.rollout.flat import rollout_flat
from trace_core.store.schema import write_trees

WORKER = Path(__file__).with_name("ranks_worker.py")
SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
CONFIG = UpdateConfig(
    lr=1e-3,
    minibatch=5,
    epochs=2,
    micro_tokens=100,
    old_logprobs="recompute",
    skip_flat_paths=False,
)
"""Minibatches of 5 paths split 3 / 2 between the ranks; 100 padded tokens hold two or three
of these paths, so the ranks' micro-batch counts differ."""
HANG_SECONDS = 240
"""Far above what the run takes (seconds); a rank waiting in a collective never ends."""


@pytest.fixture(scope="module")
def problem(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ranks")
    suite = CalcSuite(seed=3, train_size=24, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    model = create_policy(tokenizer, SMALL, seed=0)
    save_checkpoint(model, tokenizer, root / "policy")
    trees = rollout_flat(
        TorchEngine(model),
        TurnFormat(tokenizer),
        suite.make_env,
        suite.tasks("train")[:6],
        SamplingParams(n=4, max_tokens=16),
        seed=0,
    )
    for tree in trees:
        tree.reward[np.flatnonzero(tree.leaf_mask)[:2]] = 1.0
    write_trees(root / "trees.parquet", trees)
    return root / "policy", root / "trees.parquet"


def rank_passes(trees_path: Path) -> list[tuple[int, int]]:
    """Each minibatch's micro-batch count on rank 0 and on rank 1 (update_policy's draws)."""
    from trace_core.store.schema import read_trees

    paths = tree_paths(read_trees(trees_path), CONFIG.estimator)
    rng = np.random.default_rng(7)
    counts = []
    for _ in range(CONFIG.epochs):
        order = rng.permutation(len(paths))
        for start in range(0, len(paths), CONFIG.minibatch):
            picked = order[start : start + CONFIG.minibatch]
            if len(picked) < 2:
                continue
            counts.append(
                tuple(
                    len(pack([len(paths[i].tokens) for i in picked[r::2]], CONFIG.micro_tokens))
                    for r in (0, 1)
                )
            )
    return counts  # type: ignore[return-value]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(mode: str, policy: Path, trees: Path, out: Path) -> None:
    """Both ranks as processes of their own session; killed by pid if they outlive
    ``HANG_SECONDS``, which fails the test as a hang."""
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    config = json.dumps(asdict(CONFIG))
    args = [sys.executable, str(WORKER), mode, str(policy), str(trees), str(out), config]
    ranks = [
        subprocess.Popen(args, env={**env, "RANK": str(r)}, start_new_session=True) for r in (0, 1)
    ]
    try:
        codes = [rank.wait(timeout=HANG_SECONDS) for rank in ranks]
    except subprocess.TimeoutExpired:
        codes = []
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait()
    assert codes, f"{mode}: the ranks were still running after {HANG_SECONDS} s (a hang)"
    assert codes == [0, 0], f"{mode}: ranks exited with {codes}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_ranks_with_different_pass_counts_finish_and_equal_one_process(
    problem: tuple[Path, Path], tmp_path: Path, mode: str
) -> None:
    policy, trees = problem
    counts = rank_passes(trees)
    assert any(a != b for a, b in counts), counts  # the ranks' micro-batch counts differ

    run_ranks(mode, policy, trees, tmp_path)

    from trace_core.store.schema import read_trees

    model, tokenizer = load_checkpoint(policy)
    single = update_policy(
        model,
        make_optimizer(model, CONFIG),
        read_trees(trees),
        CONFIG,
        np.random.default_rng(7),
        tokenizer.pad_token_id,
    )
    got = load_file(str(tmp_path / "weights.safetensors"))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["steps"] == single.steps == len(counts)
    assert stats["passes"] == sum(max(a, b) for a, b in counts)  # rank 0 ran the agreed count
