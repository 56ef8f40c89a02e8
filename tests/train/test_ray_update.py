"""The policy update on Ray Train (real in-process Ray, gloo DDP on CPU) against the in-process
update it must reproduce."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import make_optimizer, update_policy
from trace_core.policy.update_config import UpdateConfig
from trace_core.rollout.flat import rollout_flat
from trace_core.store.artifacts import open_store
from trace_core.store.schema import read_trees, write_trees
from trace_core.store.sync import download_folder, upload_folder
from trace_core.train.ray_update import update_on_ray

pytestmark = pytest.mark.slow

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
CONFIG = UpdateConfig(lr=1e-3, minibatch=16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A tiny policy, trees with mixed rewards, and the in-process update's weights."""
    root = tmp_path_factory.mktemp("ray-update")
    suite = CalcSuite(seed=2, train_size=24, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    model = create_policy(tokenizer, SMALL, seed=0)
    save_checkpoint(model, tokenizer, root / "policy")
    trees = rollout_flat(
        TorchEngine(model),
        TurnFormat(tokenizer),
        suite.make_env,
        suite.tasks("train")[:10],
        SamplingParams(n=4, max_tokens=10),
        seed=0,
    )
    for tree in trees:  # the untrained policy never wins: give each group a mixed outcome
        tree.reward[np.flatnonzero(tree.leaf_mask)[::2]] = 1.0
    write_trees(root / "trees.parquet", trees)
    update_policy(
        model,
        make_optimizer(model, CONFIG),
        trees,
        CONFIG,
        np.random.default_rng(7),
        tokenizer.pad_token_id,
    )
    return (
        root / "policy",
        root / "trees.parquet",
        {k: v.clone() for k, v in model.state_dict().items()},
    )


def test_two_ray_train_workers_reproduce_the_in_process_update(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    policy, trees, expected = setup
    stats = update_on_ray(policy, trees, tmp_path / "out", CONFIG, seed=7, workers=2)
    check_update(stats, policy, tmp_path / "out", expected)


@pytest.mark.cluster  # the session's S3 server
def test_ray_train_workers_read_and_write_s3(setup, s3_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every location an s3:// URI, as in a Ray job on a cluster whose pods share no disk:
    the worker downloads its inputs, rank 0 uploads the result, and one worker's update is
    the in-process one."""
    policy, trees, expected = setup
    root = f"s3://trace/ray-update/{uuid.uuid4().hex[:8]}"
    upload_folder(policy, f"{root}/policy")
    open_store(f"{root}/trees").put_file("trees.parquet", trees)
    stats = update_on_ray(
        f"{root}/policy", f"{root}/trees/trees.parquet", f"{root}/out", CONFIG, seed=7, workers=1
    )
    download_folder(f"{root}/out", tmp_path / "out")
    check_update(stats, policy, tmp_path / "out", expected)


@pytest.fixture(scope="module")
def resumed(setup, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A second in-process update, from the first one's policy and AdamW state: (its input
    policy, its input optimizer file, the weights and the optimizer state it gives)."""
    from trace_core.policy.model import load_checkpoint
    from trace_core.policy.update import save_optimizer

    policy, trees, _ = setup
    root = tmp_path_factory.mktemp("resumed")
    model, tokenizer = load_checkpoint(policy)
    optimizer = make_optimizer(model, CONFIG)
    paths = read_trees(trees)

    def step(seed: int) -> None:
        rng = np.random.default_rng(seed)
        update_policy(model, optimizer, paths, CONFIG, rng, tokenizer.pad_token_id)

    step(7)
    save_checkpoint(model, tokenizer, root / "first")
    save_optimizer(optimizer, root / "first/optimizer.safetensors")
    step(8)
    save_optimizer(optimizer, root / "second-optimizer.safetensors")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return (
        root / "first",
        root / "first/optimizer.safetensors",
        weights,
        root / "second-optimizer.safetensors",
    )


@pytest.mark.cluster  # Ray in this process (gloo)
def test_fsdp_over_two_workers_gives_the_in_process_update_and_optimizer(  # type: ignore[no-untyped-def]
    setup, resumed, tmp_path: Path
) -> None:
    """fsdp=True: the policy and AdamW's moments sharded over two workers, the optimizer state
    read from and written to the single-process file; the update is the in-process one."""
    _, trees, _ = setup
    policy, optimizer, expected, expected_optimizer = resumed
    out = tmp_path / "out"
    stats = update_on_ray(
        policy, trees, out, CONFIG, seed=8, workers=2, optimizer_path=optimizer, fsdp=True
    )
    check_update(stats, policy, out, expected)
    got, want = load_file(str(out / "optimizer.safetensors")), load_file(str(expected_optimizer))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6, rtol=1e-4), name


def check_update(  # type: ignore[no-untyped-def]
    stats, policy: Path, out: Path, expected: dict[str, torch.Tensor]
) -> None:
    assert stats.steps == 3 and stats.paths == 40  # 40 paths in minibatches of 16
    got = load_file(str(out / "model.safetensors"))
    before = load_file(str(policy / "model.safetensors"))
    for name, value in got.items():
        key = name if name in expected else f"model.{name}"
        assert torch.allclose(value, expected.get(name, expected.get(key)), atol=2e-5), name
    assert any(not torch.equal(got[k], before[k]) for k in got)
    assert (out / "optimizer.safetensors").is_file()
