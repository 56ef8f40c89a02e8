"""The policy update on Ray Train: ``update_policy`` data-parallel over ``TorchTrainer`` workers.

    stats = update_on_ray(policy_dir, trees_path, out_dir, UpdateConfig(), seed=3, workers=2)

Each worker loads the policy (and the optimizer state, when there is one) from shared paths,
wraps the model in DDP (``prepare_model``: gloo on CPU, NCCL on GPU), and runs the same
``update_policy`` on its slice of every minibatch; the token-count scaling there makes the
averaged gradient the single-process one, so one worker reproduces the in-process update.
Rank 0 writes the updated policy (an HF directory) and the optimizer state to ``out_dir``.

This is the only module of the training layer that imports Ray. Without an address Ray
starts in this process; with one (``host:port`` of a head, or ``ray://``) the workers run on
the cluster, and every path must then be on storage all nodes share.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from trace_core.policy.update import UpdateStats
from trace_core.policy.update_config import UpdateConfig

OPTIMIZER = "optimizer.safetensors"
STATS = "update.json"


def update_on_ray(
    policy_dir: Path,
    trees_path: Path,
    out_dir: Path,
    config: UpdateConfig,
    seed: int,
    workers: int,
    optimizer_path: Path | None = None,
    reference_dir: Path | None = None,
    address: str | None = None,
    use_gpu: bool = False,
) -> UpdateStats:
    """One update of the policy in ``policy_dir`` on the trees in ``trees_path``."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from trace_core.rollout.ray_pool import ray_session

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loop_config = {
        "policy": str(policy_dir.resolve()),
        "trees": str(trees_path.resolve()),
        "out": str(out_dir.resolve()),
        "optimizer": str(optimizer_path.resolve()) if optimizer_path else None,
        "reference": str(reference_dir.resolve()) if reference_dir else None,
        "update": asdict(config),
        "seed": seed,
    }
    with ray_session(address, num_cpus=workers), tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config=loop_config,
            scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=use_gpu),
            run_config=ray.train.RunConfig(name="update", storage_path=storage),
        )
        trainer.fit()
    return UpdateStats(**json.loads((out_dir / STATS).read_text()))


def _train_worker(loop_config: dict[str, object]) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import ray.train.torch
    import torch

    from trace_core.policy.model import load_checkpoint, save_checkpoint
    from trace_core.policy.update import (
        TokenScorer,
        load_optimizer,
        make_optimizer,
        save_optimizer,
        update_policy,
    )
    from trace_core.store.schema import read_trees

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    config = UpdateConfig(**loop_config["update"])  # type: ignore[arg-type]
    device = ray.train.torch.get_device()
    model, tokenizer = load_checkpoint(str(loop_config["policy"]), device=device)
    reference = None
    if loop_config["reference"] and config.kl_coef > 0:
        reference, _ = load_checkpoint(str(loop_config["reference"]), device=device)
    optimizer = make_optimizer(model, config)  # on the bare module: DDP shares its parameters
    if loop_config["optimizer"]:
        load_optimizer(optimizer, str(loop_config["optimizer"]))
    # DDP wraps the scorer (decoder + chunked head), the module each pass calls.
    ddp = ray.train.torch.prepare_model(
        TokenScorer(model, config.logit_chunk), move_to_device=False
    )
    trees = read_trees(str(loop_config["trees"]))
    stats = update_policy(
        ddp,
        optimizer,
        trees,
        config,
        np.random.default_rng(int(loop_config["seed"])),  # type: ignore[arg-type]
        tokenizer.pad_token_id,
        reference,
        rank=rank,
        world=world,
    )
    if rank == 0:
        out = Path(str(loop_config["out"]))
        save_checkpoint(model, tokenizer, out)
        save_optimizer(optimizer, out / OPTIMIZER)
        (out / STATS).write_text(json.dumps(asdict(stats)))
    if world > 1:
        torch.distributed.barrier()  # the files are whole before any worker reports
    ray.train.report({"paths": stats.paths, "loss": stats.loss})
