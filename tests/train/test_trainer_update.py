"""The update on the trainer actors (real in-process Ray, gloo DDP or FSDP on CPU) against the
in-process update it must reproduce, with the inputs and the checkpoint local or on S3."""

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
from trace_core.rollout.ray_pool import ray_session
from trace_core.store.schema import read_trees, write_trees
from trace_core.store.sync import download_folder, upload_folder
from trace_core.train.start_state import StartState
from trace_core.train.trainer_group import TrainerGroup, TrainerSpec

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # Ray in this process


def update_on_trainers(  # type: ignore[no-untyped-def]
    start: StartState, trees: str, out: str, seed: int, workers: int, fsdp: bool = False
):
    """One update on a trainer group of ``workers`` actors (the trees are read here and put in
    Ray's object store, as a session step does), then its checkpoint at ``out``
    (``out/policy``, ``out/optimizer.safetensors``); the update's stats."""
    with ray_session(None), TrainerGroup(TrainerSpec(CONFIG, workers, fsdp=fsdp), start) as group:
        stats = group.update(read_trees(trees), seed)
        group.save(out)
    return stats


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


def test_two_trainers_reproduce_the_in_process_update(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    policy, trees, expected = setup
    out = tmp_path / "out"
    stats = update_on_trainers(StartState(str(policy)), str(trees), str(out), seed=7, workers=2)
    check_update(stats, policy, out, expected)


def test_a_trainer_reads_its_start_from_s3_and_writes_its_checkpoint_there(  # type: ignore[no-untyped-def]
    setup, s3_env, tmp_path: Path
) -> None:
    """Every location an s3:// URI, as on a cluster whose pods share no disk: the trainer
    downloads its start, rank 0 uploads the checkpoint, and one trainer's update is the
    in-process one."""
    policy, trees, expected = setup
    root = f"s3://trace/trainer-update/{uuid.uuid4().hex[:8]}"
    upload_folder(policy, f"{root}/policy")
    stats = update_on_trainers(StartState(f"{root}/policy"), str(trees), f"{root}/out", 7, 1)
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


def test_fsdp_over_two_trainers_gives_the_in_process_update_and_optimizer(  # type: ignore[no-untyped-def]
    setup, resumed, tmp_path: Path
) -> None:
    """fsdp=True: the policy and AdamW's moments sharded over two trainers, the optimizer
    state read from and written to the single-process file; the update is the in-process one."""
    _, trees, _ = setup
    policy, optimizer, expected, expected_optimizer = resumed
    out = tmp_path / "out"
    start = StartState(str(policy), optimizer=str(optimizer))
    stats = update_on_trainers(start, str(trees), str(out), seed=8, workers=2, fsdp=True)
    check_update(stats, policy, out, expected)
    got, want = load_file(str(out / "optimizer.safetensors")), load_file(str(expected_optimizer))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6, rtol=1e-4), name


def check_update(  # type: ignore[no-untyped-def]
    stats, policy: Path, out: Path, expected: dict[str, torch.Tensor]
) -> None:
    assert stats.steps == 3 and stats.paths == 40  # 40 paths in minibatches of 16
    got = load_file(str(out / "policy" / "model.safetensors"))
    before = load_file(str(policy / "model.safetensors"))
    for name, value in got.items():
        key = name if name in expected else f"model.{name}"
        assert torch.allclose(value, expected.get(name, expected.get(key)), atol=2e-5), name
    assert any(not torch.equal(got[k], before[k]) for k in got)
    assert (out / "optimizer.safetensors").is_file()
