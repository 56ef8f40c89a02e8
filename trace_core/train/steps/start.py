"""The steps that start a run: prep (parameters → config, prompts, where the policy starts),
then warmstart (the synthetic tasks' tiny policy from scratch, or a base model fine-tuned on the
task's reference solutions with ``warmstart_init``) or load (a base model, or the run's latest
registered checkpoint to resume from).

The warm start's policy is small (a few MB) and travels as the step's output folders. Load's
outputs hold references instead (``store.reference``: ``reference.json`` naming the base model
or the checkpoint's folders), so no step downloads into its pod weights it does not compute
on: open session's trainers and engines read them where they lie (``train.dispatch``).

    prep = prep_step(PipelineParameters(task="calc", iterations=2), Path("prompts"))
    config = PipelineConfig.from_json(prep.config_json)
    warmstart_step(config, Path("policy-0"), Path("predictor-0"), Path("optimizer-0"))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trace_core.envs.base import TaskSuite
from trace_core.envs.suites import SYNTHETIC
from trace_core.store.s3_settings import check_run_store
from trace_core.train.contract import (
    OPTIMIZER,
    PROMPTS_EVAL,
    PROMPTS_TRAIN,
    PipelineConfig,
    PipelineParameters,
    session_name,
    write_metrics,
    write_optimizer_info,
)

if TYPE_CHECKING:
    from trace_core.store.registry import Checkpoint, CheckpointRegistry


log = logging.getLogger(__name__)

BASE_MODEL = "base_model"
"""The registry metadata that records what a run started from (its ``base_model_uri``)."""


@dataclass(frozen=True)
class PrepResult:
    config_json: str
    start: str
    """warmstart (a synthetic task's tiny policy from scratch) or load (base model or resume)."""
    start_iteration: int
    """Iterations already done: the registry checkpoint's when resuming, else 0."""
    prompts: int
    eval_prompts: int


def prep_step(
    params: PipelineParameters,
    prompts_dir: Path,
    suite: TaskSuite | None = None,
    pipeline_run_id: str = "",
) -> PrepResult:
    """Validate the parameters into the run's config, write its prompts, decide the start.
    ``pipeline_run_id``: the KFP run's id, which names the run's session (``with_session``)."""
    from trace_core.envs.prompts import write_prompts
    from trace_core.envs.suites import make_suite

    config = with_session(_base_model_defaults(params.config(), params), pipeline_run_id)
    train = config.train
    suite = suite or make_suite(train.task, train.data, train.seed, train.retriever_url)
    train_tasks = suite.tasks("train")
    eval_tasks = suite.tasks("eval")[: train.eval_tasks]
    write_prompts(prompts_dir / PROMPTS_TRAIN, train.task, train_tasks)
    write_prompts(prompts_dir / PROMPTS_EVAL, train.task, eval_tasks)
    start, done = ("load" if train.init and not train.warmstart_init else "warmstart"), 0
    if config.run_name:
        checkpoint = open_registry(config).latest(config.run_name, say=log.warning)
        if checkpoint is not None:
            _check_same_base(checkpoint.metadata, config)
            start, done = "load", checkpoint.iteration
    return PrepResult(config.to_json(), start, done, len(train_tasks), len(eval_tasks))


SESSION_KEEP_ALIVE_S = 1800.0
"""How long the session's engine actors outlive the run's last call when its last step never
came (a failed run); they stop sooner when it ends."""


def with_session(config: PipelineConfig, pipeline_run_id: str = "") -> PipelineConfig:
    """The config with what a run's session needs (``train.steps.session``): a name of its own,
    at least one trainer and one kept engine actor, and a store for its checkpoints. The name
    is ``<run_id>-<8 hex>`` (``contract.session_name``): from ``pipeline_run_id`` (the KFP
    run's id) when given, so the run's exit handler, which has that id but no step's output,
    finds the session (``train.release``); else random. The trainers and engines stop
    themselves after the engine's ``keep_alive_s`` without a call (30 min by default)."""
    if not config.store:
        raise ValueError("store_uri is empty: the run's checkpoints are written there")
    check_run_store(config.store)
    train = config.train
    engine = train.engine
    if not engine.workers or not engine.keep_alive_s:
        engine = dataclasses.replace(
            engine,
            workers=engine.workers or 1,
            keep_alive_s=engine.keep_alive_s or SESSION_KEEP_ALIVE_S,
        )
    train = dataclasses.replace(train, engine=engine, train_workers=train.train_workers or 1)
    name = session_name(config.run_name, pipeline_run_id)
    return dataclasses.replace(config, train=train, engine_name=name)


def _check_same_base(metadata: Mapping[str, str], config: PipelineConfig) -> None:
    """A run name resumes only the run of the same base model (checkpoints that predate the
    record pass)."""
    stored, given = metadata.get(BASE_MODEL), str(config.train.init or "")
    if stored is not None and stored != given:
        started = f"base model {stored}" if stored else "the warm-started tiny policy"
        asked = f"base_model_uri {given}" if given else "no base_model_uri"
        raise ValueError(
            f"run_name {config.run_name!r}: its checkpoints start from {started}, but this run "
            f"has {asked}; give it another run_name (or the same base model to resume)"
        )


def _base_model_defaults(config: PipelineConfig, params: PipelineParameters) -> PipelineConfig:
    """A pretrained base model (not the tiny policy's word-level tokenizer) gets ``PRETRAINED``'s
    values for the fields ``settings_json`` does not set, as ``trace-rl train --init`` does."""
    from trace_core.policy.format import is_word_tokenizer
    from trace_core.train.base_model import source_tokenizer
    from trace_core.train.config import with_pretrained_defaults

    if not params.base_model_uri:
        return config
    if is_word_tokenizer(source_tokenizer(params.base_model_uri, "base_model_uri")):
        return config
    settings = json.loads(params.settings_json or "{}")
    update = settings.get("update")
    explicit = set(settings) | (set(update) if isinstance(update, dict) else set())
    train, notes = with_pretrained_defaults(config.train, explicit)
    for note in notes:
        log.info("pretrained base model: %s; set it in settings_json", note)
    return dataclasses.replace(config, train=train)


def warmstart_step(
    config: PipelineConfig, policy_dir: Path, predictor_dir: Path, optimizer_dir: Path
) -> dict[str, float]:
    """SFT of the synthetic task's tiny policy, or of the base model (``warmstart_init``) on the
    task's reference solutions; the fresh predictor and an empty optimizer state beside it."""
    from trace_core.policy.model import load_checkpoint
    from trace_core.train.base_model import fetch_model
    from trace_core.train.iteration import new_predictor, warmstart_config
    from trace_core.train.progress import LineProgress
    from trace_core.train.warmstart import warmstart

    if config.train.task not in SYNTHETIC:
        raise ValueError(
            f"task {config.train.task!r} has no warm start: set base_model_uri "
            f"(warm starts exist for {', '.join(SYNTHETIC)})"
        )
    with tempfile.TemporaryDirectory(prefix="base-model-") as scratch:
        init = config.train.init
        base = fetch_model(init, Path(scratch) / "base", "base_model_uri") if init else None
        settings = warmstart_config(config.train, policy_dir, base)
        bar = LineProgress("warm start", settings.sft.steps, "SFT steps")
        report = warmstart(
            settings, progress=lambda step, loss: bar(step + 1, loss=loss), stage=bar.note
        )
    _, tokenizer = load_checkpoint(policy_dir)
    new_predictor(config.train, tokenizer).save(predictor_dir)
    write_optimizer_info(optimizer_dir, 0)
    success = list(report.success.values())
    metrics = {
        "warmstart_steps": float(report.steps),
        "warmstart_final_loss": report.final_loss,
        "warmstart_seconds": report.train_seconds,
        "warmstart_success": sum(success) / len(success) if success else 0.0,
    }
    if base is not None and report.parse_rate_before is not None:
        metrics |= {
            "warmstart_parse_rate_before": report.parse_rate_before,
            "warmstart_parse_rate": report.parse_rate,
            "warmstart_success_all_before": float(report.success_all_before or 0.0),
            "warmstart_success_all": report.success_all,
        }
    write_metrics(policy_dir, metrics)
    return metrics


def load_step(
    config: PipelineConfig, policy_dir: Path, predictor_dir: Path, optimizer_dir: Path
) -> dict[str, float]:
    """Where the run's session starts, as references (``store.reference``): no weights are
    read or written here, since the session's trainers and engines read them where they lie.

    Resuming (the run's latest registry checkpoint): ``policy_dir`` refers to the checkpoint's
    ``policy/`` (its log travels with it), ``optimizer_dir`` to the folder that holds its
    ``optimizer.safetensors`` (and ``master.safetensors``), each with the iteration; its
    predictor (a few MB) is copied into ``predictor_dir``. Else the base model
    (``train.init``): ``policy_dir`` refers to it, only its config and tokenizer files are
    read (to build the fresh predictor), and the optimizer starts empty (``optimizer.json`` of
    iteration 0, no reference)."""
    from trace_core.store.reference import Reference, write_reference
    from trace_core.train.base_model import check_source, local_path, source_tokenizer
    from trace_core.train.iteration import new_predictor

    registry = open_registry(config)
    checkpoint = registry.latest(config.run_name, say=log.warning) if config.run_name else None
    if checkpoint is not None:
        root = registry.store.uri(checkpoint.key)
        paths = {f.path for f in checkpoint.files}
        for part in ("policy", "predictor"):
            if not any(p.startswith(f"{part}/") for p in paths):
                raise FileNotFoundError(f"{root}: the checkpoint has no {part}/ folder")
        _copy_predictor(registry, checkpoint, predictor_dir)
        write_reference(policy_dir, Reference(f"{root}/policy", checkpoint.iteration))
        optimizer = _optimizer_folder(paths)
        if optimizer is not None:
            where = f"{root}/{optimizer}" if optimizer else root
            write_reference(optimizer_dir, Reference(where, checkpoint.iteration))
        write_optimizer_info(optimizer_dir, checkpoint.iteration)
        metrics = {"resumed_iteration": float(checkpoint.iteration)}
    elif config.train.init:
        source = str(config.train.init)
        check_source(source, "base_model_uri")
        tokenizer = source_tokenizer(source, "base_model_uri")
        local = local_path(source)
        uri = source if local is None else str(local.absolute())
        write_reference(policy_dir, Reference(uri, 0))
        new_predictor(config.train, tokenizer).save(predictor_dir)
        write_optimizer_info(optimizer_dir, 0)
        metrics = {"resumed_iteration": 0.0}
    else:
        raise ValueError("nothing to load: no base_model_uri and no checkpoint of run_name")
    write_metrics(policy_dir, metrics)
    return metrics


def _optimizer_folder(paths: set[str]) -> str | None:
    """The checkpoint's folder (relative; "" its root) holding its optimizer state, in each
    layout registered: a session's (beside ``policy/``), ``optimizer/``, or ``policy/`` (before
    the optimizer state was an artifact of its own); None: it has none."""
    for folder in ("", "optimizer", "policy"):
        if f"{folder}/{OPTIMIZER}".lstrip("/") in paths:
            return folder
    return None


def _copy_predictor(registry: CheckpointRegistry, checkpoint: Checkpoint, target: Path) -> None:
    """The checkpoint's ``predictor/`` into ``target`` (its files checked against the
    manifest), whole or not at all."""
    only = dataclasses.replace(
        checkpoint, files=tuple(f for f in checkpoint.files if f.path.startswith("predictor/"))
    )
    staging = target.parent / f".predictor-{uuid.uuid4().hex[:8]}"
    try:
        registry.download(only, staging)
        if target.exists():
            target.rmdir()  # a fresh output folder: empty
        os.replace(staging / "predictor", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def open_registry(config: PipelineConfig) -> CheckpointRegistry:
    """The checkpoint registry below the run's store."""
    from trace_core.store.artifacts import open_store
    from trace_core.store.registry import CheckpointRegistry

    return CheckpointRegistry(open_store(config.store))
