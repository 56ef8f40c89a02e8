"""The policy update on Ray Train: ``update_policy`` data-parallel over ``TorchTrainer`` workers.

    stats = update_on_ray(policy_dir, trees_path, out_dir, UpdateConfig(), seed=3, workers=2)

Each worker loads the policy (and the optimizer state, when there is one), wraps the model in
DDP (``prepare_model``: gloo on CPU, NCCL on GPU) or, with ``fsdp``, shards it and the
optimizer state across the workers (``policy.sharding``), and runs the same ``update_policy``
on its slice of every minibatch; the token-count scaling there makes the averaged gradient the
single-process one, so one worker reproduces the in-process update. Rank 0 writes the updated
policy (an HF directory, in the dtype the input policy is served in) and the optimizer state to
``out_dir``, and the fp32 master weights (``master.safetensors``) when that dtype rounds them;
``master_path`` brings the previous update's back in. Workers train float32 parameters whatever
the checkpoint holds; under FSDP on GPUs the sharded parameters are gathered in bf16 for the
arithmetic and gradients reduced in fp32 (``policy.sharding``).

Every location is a local path or an ``s3://`` URI. Workers on a cluster's other pods cannot
see the caller's disk: each downloads remote inputs to its own scratch folder, and rank 0
uploads the result when ``out_dir`` is remote (the caller publishes it from there). With
``use_gpu`` every worker asks Ray for one GPU, so the cluster's GPU group starts for it.

This is the only module of the training layer that imports Ray. Without an address Ray
starts in this process; with one (``host:port`` of a head, ``auto`` inside a Ray job) the
workers run on the cluster.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from trace_core.policy.update import UpdateStats
from trace_core.policy.update_config import UpdateConfig
from trace_core.store.uri import is_remote

OPTIMIZER = "optimizer.safetensors"
STATS = "update.json"


Location = str | Path
"""A local path, or an ``s3://`` URI of the same file or folder."""


def update_on_ray(
    policy_dir: Location,
    trees_path: Location,
    out_dir: Location,
    config: UpdateConfig,
    seed: int,
    workers: int,
    optimizer_path: Location | None = None,
    reference_dir: Location | None = None,
    address: str | None = None,
    use_gpu: bool = False,
    fsdp: bool = False,
    master_path: Location | None = None,
) -> UpdateStats:
    """One update of the policy in ``policy_dir`` on the trees in ``trees_path`` (a Parquet
    file); ``optimizer_path`` is a file, the others folders. ``fsdp``: shard the policy and its
    optimizer state across the workers (``policy.sharding``) instead of replicating them."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from trace_core.rollout.ray_pool import ray_session

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loop_config = {
        "policy": _absolute(policy_dir),
        "trees": _absolute(trees_path),
        "out": _absolute(out_dir),
        "optimizer": _absolute(optimizer_path) if optimizer_path else None,
        "reference": _absolute(reference_dir) if reference_dir else None,
        "master": _absolute(master_path) if master_path else None,
        "update": asdict(config),
        "seed": seed,
        "fsdp": fsdp,
    }
    with ray_session(address, num_cpus=workers), tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config=loop_config,
            scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=use_gpu),
            run_config=ray.train.RunConfig(name="update", storage_path=storage),
        )
        trainer.fit()
    if is_remote(str(out_dir)):
        from trace_core.store.artifacts import open_store

        return UpdateStats(**json.loads(open_store(str(out_dir)).get_bytes(STATS)))
    return UpdateStats(**json.loads((Path(out_dir) / STATS).read_text()))


def _absolute(location: Location) -> str:
    text = str(location)
    return text if is_remote(text) else str(Path(text).resolve())


def local_copy(location: str, scratch: Path, name: str, folder: bool) -> str:
    """A worker's local copy of an input: the path itself, or its download into ``scratch``."""
    if not is_remote(location):
        return location
    from trace_core.store.artifacts import open_store
    from trace_core.store.sync import download_folder

    target = scratch / name
    if folder:
        download_folder(location, target)
        return str(target)
    parent, _, key = location.rstrip("/").rpartition("/")
    target.mkdir(parents=True, exist_ok=True)
    open_store(parent).get_file(key, target / key)
    return str(target / key)


def _train_worker(loop_config: dict[str, object]) -> None:
    """Runs on every Ray Train worker, in a scratch folder of its own."""
    with tempfile.TemporaryDirectory(prefix="trace-update-") as scratch:
        _update_worker(loop_config, Path(scratch))


def _update_worker(loop_config: dict[str, object], scratch: Path) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from trace_core.policy.model import (
        load_checkpoint,
        load_for_training,
        load_master,
        save_checkpoint,
        save_master,
    )
    from trace_core.policy.sharding import (
        full_weights,
        load_sharded_optimizer,
        save_sharded_optimizer,
        shard_scorer,
    )
    from trace_core.policy.tokenizer import padding_id
    from trace_core.policy.update import (
        TokenScorer,
        load_optimizer,
        make_optimizer,
        save_optimizer,
        update_policy,
    )
    from trace_core.store.schema import read_trees

    def fetched(name: str, folder: bool = True) -> str:
        return local_copy(str(loop_config[name]), scratch, name, folder)

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    config = UpdateConfig(**loop_config["update"])  # type: ignore[arg-type]
    device = ray.train.torch.get_device()
    policy = fetched("policy")
    model, tokenizer, serving = load_for_training(policy, device=device)
    if loop_config["master"]:
        load_master(model, Path(fetched("master", folder=False)).parent)
    reference = None
    if loop_config["reference"] and config.kl_coef > 0:
        reference, _ = load_checkpoint(fetched("reference"), device=device)
    if loop_config["fsdp"]:
        scorer = shard_scorer(TokenScorer(model, config.logit_chunk), device.type == "cuda")
        optimizer = make_optimizer(model, config)  # after sharding: on this rank's shards
        if loop_config["optimizer"]:
            load_sharded_optimizer(model, optimizer, fetched("optimizer", folder=False))
    else:
        optimizer = make_optimizer(model, config)  # on the bare module: DDP shares its parameters
        if loop_config["optimizer"]:
            load_optimizer(optimizer, fetched("optimizer", folder=False))
        # DDP wraps the scorer (decoder + chunked head), the module each pass calls.
        scorer = ray.train.torch.prepare_model(
            TokenScorer(model, config.logit_chunk), move_to_device=False
        )
    trees = read_trees(fetched("trees", folder=False))
    stats = update_policy(
        scorer,
        optimizer,
        trees,
        config,
        np.random.default_rng(int(loop_config["seed"])),  # type: ignore[arg-type]
        padding_id(tokenizer),
        reference,
        rank=rank,
        world=world,
        serving=serving,
    )
    target = str(loop_config["out"])
    out = scratch / "out" if is_remote(target) else Path(target)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if loop_config["fsdp"]:  # collectives: every rank gathers, rank 0 writes
        weights = full_weights(model)
        save_sharded_optimizer(model, optimizer, out / OPTIMIZER, rank)
        if rank == 0:
            model, _ = load_checkpoint(policy, dtype=torch.float32)
            model.load_state_dict(weights)
    elif rank == 0:
        save_optimizer(optimizer, out / OPTIMIZER)
    if rank == 0:
        save_checkpoint(model, tokenizer, out, dtype=serving)
        save_master(model, out, serving)
        (out / STATS).write_text(json.dumps(asdict(stats)))
        if is_remote(target):
            from trace_core.store.sync import upload_folder

            upload_folder(out, target)
    if world > 1:
        torch.distributed.barrier()  # the files are whole before any worker reports
    ray.train.report({"paths": stats.paths, "loss": stats.loss})
