"""The steps of one training iteration: rollout (grow the trees), then fit-predictor and update
(both read the trees; they run side by side in the pipeline).

    rollout_step(config, 1, Path("prompts"), Path("policy-0"), Path("predictor-0"), Path("trees-1"))
    fit_predictor_step(config, 1, Path("trees-1"), Path("policy-0"), Path("predictor-0"), ...)
    update_step(config, 1, Path("trees-1"), Path("policy-0"), Path("policy-0"), Path("optimizer-0"),
                Path("policy-1"), Path("optimizer-1"))

Each draws through ``train.iteration`` exactly as ``train.loop`` does, so a pipeline run from a
given starting policy samples and learns what ``trace-rl train`` does from it.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from trace_core.envs.base import TaskSuite
from trace_core.policy.checkpoint import load_tokenizer
from trace_core.train.contract import (
    OPTIMIZER,
    OPTIMIZER_INFO,
    PROMPTS_TRAIN,
    TREES,
    PipelineConfig,
    read_draws,
    write_draws,
    write_metrics,
    write_optimizer_info,
)
from trace_core.train.record import LOG, IterationRecord, read_log


def rollout_step(
    config: PipelineConfig,
    iteration: int,
    prompts_dir: Path,
    policy_dir: Path,
    predictor_dir: Path,
    trees_dir: Path,
    suite: TaskSuite | None = None,
    engine_checkpoint: str | None = None,
) -> dict[str, float]:
    """Grow iteration ``iteration``'s trees with the policy; ``trees_dir/trees.parquet``.
    ``engine_checkpoint``: where the engine actors load the policy from (its ``s3://`` URI),
    when ``policy_dir`` holds only its tokenizer and config."""
    from trace_core.algo.plan import Budget
    from trace_core.envs.prompts import read_prompts
    from trace_core.envs.suites import make_suite
    from trace_core.policy.value import ValuePredictor
    from trace_core.store.schema import write_trees
    from trace_core.train.draws import draw_iteration
    from trace_core.train.iteration import roll_out
    from trace_core.train.progress import LineProgress

    train = config.train
    task, tasks = read_prompts(str(prompts_dir / PROMPTS_TRAIN))
    suite = suite or make_suite(task, train.data, train.seed)
    tokenizer = load_tokenizer(policy_dir)
    predictor = ValuePredictor.load(predictor_dir, tokenizer)
    draws = draw_iteration(train.seed, iteration, len(tasks), train.prompts)
    units = Budget(train.budget, train.continuations, train.group).units
    bar = LineProgress(f"rollout {iteration}", max(1, math.ceil(units)), "units")
    result = roll_out(
        engine_checkpoint or policy_dir, tasks, suite, predictor, train, iteration, draws,
        run_id=config.run_id, tokenizer=tokenizer, address=worker_address(config),
        progress=lambda spent: bar(math.floor(spent)), engine_name=config.engine_name,
    )  # fmt: skip
    trees_dir.mkdir(parents=True, exist_ok=True)
    write_trees(trees_dir / TREES, result.trees)
    write_draws(trees_dir, iteration, draws)
    metrics = {
        "iteration": float(iteration),
        **result.metrics.as_dict(),
        "seconds": result.seconds,
        **{f"engine_{name}": value for name, value in result.engine.items()},
    }
    write_metrics(trees_dir, metrics)
    return metrics


def fit_predictor_step(
    config: PipelineConfig,
    iteration: int,
    trees_dir: Path,
    policy_dir: Path,
    predictor_dir: Path,
    predictor_out: Path,
) -> dict[str, float]:
    """Refit the predictor on this iteration's trees (and its replay of earlier ones)."""
    from trace_core.policy.value import ValuePredictor
    from trace_core.store.schema import read_trees
    from trace_core.train.iteration import fit_predictor

    tokenizer = load_tokenizer(policy_dir)
    predictor = ValuePredictor.load(predictor_dir, tokenizer)
    trees = read_trees(trees_dir / TREES)
    draws = read_draws(trees_dir, iteration)
    fit = fit_predictor(predictor, trees, draws)
    predictor.save(predictor_out)
    measured = {k: float(v) for k, v in asdict(fit).items() if math.isfinite(v)}  # JSON: no NaN
    metrics = {"iteration": float(iteration), **measured}
    write_metrics(predictor_out, metrics)
    return metrics


def update_step(
    config: PipelineConfig,
    iteration: int,
    trees_dir: Path,
    policy_dir: Path,
    reference_dir: Path,
    optimizer_dir: Path,
    policy_out: Path,
    optimizer_out: Path,
    input_uris: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """One policy update on this iteration's trees: the policy and the log with this
    iteration's line go to ``policy_out``, the optimizer state to ``optimizer_out``. The
    reference policy is read only when ``kl_coef > 0``. ``input_uris``: where the inputs lie
    in object storage (a step sent as a Ray job): Ray Train workers read them there, and rank 0
    writes the result to the run's staging prefix, so no worker needs this process's disk."""
    from trace_core.algo.metrics import measure
    from trace_core.policy.model import (
        MASTER,
        load_checkpoint,
        load_for_training,
        load_master,
        resolve_device,
        save_checkpoint,
        save_master,
    )
    from trace_core.policy.tokenizer import padding_id
    from trace_core.policy.update import load_optimizer, make_optimizer, save_optimizer
    from trace_core.store.schema import read_trees
    from trace_core.train.config import check_update_place
    from trace_core.train.iteration import update

    train = config.train
    start = time.perf_counter()
    trees = read_trees(trees_dir / TREES)
    draws = read_draws(trees_dir, iteration)
    optimizer_path = optimizer_dir / OPTIMIZER
    if not optimizer_path.is_file() and not (optimizer_dir / OPTIMIZER_INFO).is_file():
        raise FileNotFoundError(
            f"{optimizer_dir}: not an optimizer folder (no {OPTIMIZER_INFO}); pass the "
            "optimizer output of the previous update, warmstart or load step"
        )
    check_update_place(config.ray_address or train.ray_address, train.train_workers, policy_dir)
    if train.train_workers:
        from trace_core.train.ray_update import update_on_ray

        uris = dict(input_uris or {})
        at = {
            "policy": uris.get("policy", policy_dir),
            "trees": uris.get("trees", trees_dir),
            "optimizer": uris.get("optimizer", optimizer_dir),
            "reference": uris.get("reference", reference_dir),
        }
        result: str | Path = policy_out
        if uris and config.store:  # else the workers share this disk (a local run)
            run = f"{config.run_id}-update-{iteration:04d}-{uuid.uuid4().hex[:8]}"
            result = f"{config.store.rstrip('/')}/staging/{run}/out/policy"
        stats = update_on_ray(
            at["policy"],
            f"{at['trees']}/{TREES}",
            result,
            train.update,
            draws.update_seed,
            train.train_workers,
            optimizer_path=f"{at['optimizer']}/{OPTIMIZER}" if optimizer_path.exists() else None,
            reference_dir=at["reference"] if train.update.kl_coef > 0 else None,
            address=worker_address(config),
            use_gpu=train.train_gpus,
            fsdp=train.train_fsdp,
            master_path=(
                f"{at['optimizer']}/{MASTER}" if (optimizer_dir / MASTER).is_file() else None
            ),
        )
        if result != policy_out:
            from trace_core.store.sync import download_folder

            download_folder(str(result), policy_out)
        (policy_out / "update.json").unlink(missing_ok=True)  # the stats go to metrics.json
        optimizer_out.mkdir(parents=True, exist_ok=True)
        os.replace(policy_out / OPTIMIZER, optimizer_out / OPTIMIZER)
        if (policy_out / MASTER).is_file():  # the fp32 weights travel with the optimizer state
            os.replace(policy_out / MASTER, optimizer_out / MASTER)
    else:
        model, tokenizer, serving = load_for_training(policy_dir, device=resolve_device())
        load_master(model, optimizer_dir)
        optimizer = make_optimizer(model, train.update)
        if optimizer_path.exists():
            load_optimizer(optimizer, optimizer_path)
        reference = None
        if train.update.kl_coef > 0:
            reference = load_checkpoint(reference_dir, device=resolve_device())[0]
        stats = update(
            model, optimizer, trees, train, draws, padding_id(tokenizer), reference, serving
        )
        save_checkpoint(model, tokenizer, policy_out, dtype=serving)
        optimizer_out.mkdir(parents=True, exist_ok=True)
        save_optimizer(optimizer, optimizer_out / OPTIMIZER)
        save_master(model, optimizer_out, serving)
    write_optimizer_info(optimizer_out, iteration)
    rollout = measure(trees)
    history = read_log(policy_dir)
    total = history[-1].total_tokens if history else 0
    record = IterationRecord(
        iteration=iteration,
        strategy=train.strategy,
        tokens=rollout.tokens,
        total_tokens=total + rollout.tokens,
        rollout=rollout.as_dict(),
        update=stats.as_dict(),
        eval=None,
        seconds={"update": time.perf_counter() - start},
    )
    lines = [json.dumps(asdict(r)) for r in [*history, record]]
    (policy_out / LOG).write_text("\n".join(lines) + "\n")
    numbers = {k: v for k, v in stats.as_dict().items() if isinstance(v, float)}  # not dtypes
    metrics = {"iteration": float(iteration), **numbers}
    write_metrics(policy_out, metrics)
    return metrics


def in_ray_job(config: PipelineConfig) -> bool:
    """Whether this is the Ray job a step of a run with a Ray dashboard address was sent as
    (Ray sets RAY_ADDRESS for a job's driver), rather than the place that sends it."""
    return bool(config.ray_address and os.environ.get("RAY_ADDRESS"))


def worker_address(config: PipelineConfig) -> str | None:
    """Where Ray Train and engine workers go: inside a step's Ray job, that job's cluster;
    otherwise the train config's head, or Ray in this process."""
    return "auto" if in_ray_job(config) else config.train.ray_address
