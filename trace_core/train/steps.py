"""The pipeline's steps as plain functions on folders: what each KFP component calls, and what
``trace-rl step`` runs inside a Ray job. Tested without KFP (tests/train/test_steps.py).

    prep ─► warmstart | load ─► [ rollout ─► fit_predictor ─┐            ] × K ─► evaluate ─► report
                                         update ────────┴─► next rollout

    params = PipelineParameters(task="calc", iterations=2, settings_json='{"budget": 16}')
    prep = prep_step(params, Path("prompts"))            # prompts/{train,eval}.parquet
    config = PipelineConfig.from_json(prep.config_json)  # every later step gets this one JSON
    warmstart_step(config, Path("policy-0"), Path("predictor-0"))
    rollout_step(config, 1, Path("prompts"), Path("policy-0"), Path("predictor-0"), Path("trees-1"))
    fit_predictor_step(config, 1, Path("trees-1"), Path("policy-0"), Path("predictor-0"), ...)
    update_step(config, 1, Path("trees-1"), Path("policy-0"), Path("policy-0"), Path("policy-1"))

Folders (the KFP artifacts):
    prompts/    train.parquet, eval.parquet (``envs.prompts``; eval holds the first eval_tasks)
    policy/     HF checkpoint + optimizer.safetensors (after the first update) + log.jsonl (one
                ``IterationRecord`` per iteration so far, so the log travels with the policy)
    predictor/  a saved ``ValuePredictor`` (before the first fit: the loop's fresh one)
    trees/      trees.parquet
Each step also writes ``metrics.json`` (flat name → number) into its first output folder; that
file is how a step run as a Ray job reports back (``run_step``).

Every step draws through ``train.iteration`` exactly as ``train.loop`` does, so a pipeline run
from a given starting policy samples and learns what ``trace-rl train`` does from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trace_core.envs.base import TaskSuite
from trace_core.train.loop import IterationRecord, TrainConfig, read_log

if TYPE_CHECKING:
    from trace_core.store.registry import CheckpointRegistry
    from trace_core.train.iteration import IterationDraws

PROMPTS_TRAIN = "train.parquet"
PROMPTS_EVAL = "eval.parquet"
TREES = "trees.parquet"
LOG = "log.jsonl"
METRICS = "metrics.json"
DRAWS = "draws.json"
OPTIMIZER = "optimizer.safetensors"
SYNTHETIC = ("calc", "multihop")
STARTS = ("warmstart", "load")
RAY_STEPS = ("rollout", "update")
"""Steps that run as a Ray job when the pipeline has a Ray dashboard address."""
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# --- the one config every step receives ------------------------------------------------------
@dataclass(frozen=True)
class PipelineConfig:
    """What travels through the pipeline as one JSON string (``to_json`` / ``from_json``)."""

    train: TrainConfig
    """The training settings, the same ones ``trace-rl train`` takes; ``train.init`` is the
    base model (HF directory or s3:// URI), None to warm-start a synthetic task's policy."""
    run_name: str = ""
    """Name of the run in the checkpoint registry: a run with a name resumes from the latest
    checkpoint under it and registers its final policy there. Empty: no registry."""
    store: str = ""
    """Artifact store root (a path or s3://bucket/prefix): ``checkpoints/`` of named runs and
    ``staging/`` for steps run as Ray jobs."""
    ray_address: str = ""
    """Empty: every step runs in its own process (Ray, where used, in-process). A Ray dashboard
    address http://HEAD:8265: rollout and update are submitted there as Ray jobs."""

    def __post_init__(self) -> None:
        if self.run_name and not _RUN_NAME.fullmatch(self.run_name):
            raise ValueError(
                f"run_name {self.run_name!r}: use letters, digits, '.', '_' and '-' "
                "(at most 128), starting with a letter or digit"
            )
        if self.run_name and not self.store:
            raise ValueError(f"run_name {self.run_name!r} needs store_uri (where checkpoints go)")
        if self.ray_address:
            if not re.fullmatch(r"https?://[^/\s]+/?", self.ray_address):
                raise ValueError(
                    f"ray_address {self.ray_address!r}: expected the Ray dashboard address "
                    "http://HEAD:8265 (Ray job submission), or empty for in-process Ray"
                )
            if not self.store.startswith(("s3://", "minio://")):
                raise ValueError(
                    "ray_address needs store_uri to be an s3:// prefix: steps run as Ray jobs "
                    f"exchange their inputs and outputs there (got {self.store!r})"
                )

    def to_json(self) -> str:
        body = {
            "train": self.train.to_json(),
            "run_name": self.run_name,
            "store": self.store,
            "ray_address": self.ray_address,
        }
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PipelineConfig:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config_json is not JSON: {err}") from None
        if not isinstance(body, dict) or not isinstance(body.get("train"), dict):
            raise ValueError("config_json: expected an object with a 'train' object")
        unknown = sorted(set(body) - {"train", "run_name", "store", "ray_address"})
        if unknown:
            raise ValueError(f"config_json: unknown field(s) {', '.join(unknown)}")
        return cls(
            train=TrainConfig.from_json(body["train"]),
            run_name=str(body.get("run_name", "")),
            store=str(body.get("store", "")),
            ray_address=str(body.get("ray_address", "")),
        )

    @property
    def run_id(self) -> str:
        """The ``run_id`` of the trees this run grows."""
        return self.run_name or "pipeline"


@dataclass(frozen=True)
class PipelineParameters:
    """The pipeline's run parameters, as a user sets them in the KFP UI (prep turns them into
    the ``PipelineConfig``). ``settings_json`` sets any other ``TrainConfig`` field."""

    task: str = "calc"
    dataset_uri: str = ""
    base_model_uri: str = ""
    strategy: str = "trace"
    budget: int = 128
    continuations: int = 2
    iterations: int = 4
    seed: int = 0
    ray_address: str = ""
    run_name: str = ""
    store_uri: str = ""
    settings_json: str = "{}"

    def config(self) -> PipelineConfig:
        try:
            settings = json.loads(self.settings_json or "{}")
        except json.JSONDecodeError as err:
            raise ValueError(f"settings_json is not JSON: {err}") from None
        if not isinstance(settings, dict):
            raise ValueError("settings_json must be a JSON object of TrainConfig fields")
        own = {"task", "data", "init", "strategy", "budget", "continuations", "iterations", "seed"}
        clash = sorted(own & set(settings))
        if clash:
            raise ValueError(
                f"settings_json sets {', '.join(clash)}: use the pipeline parameter(s) instead"
            )
        if "output" in settings or "ray_address" in settings:
            raise ValueError("settings_json may not set output or ray_address")
        if not self.base_model_uri and self.task not in SYNTHETIC:
            raise ValueError(
                f"task {self.task!r} has no built-in warm start: set base_model_uri "
                f"(warm starts exist for {', '.join(SYNTHETIC)})"
            )
        train = TrainConfig.from_json(
            {
                **settings,
                "task": self.task,
                "data": self.dataset_uri or None,
                "init": self.base_model_uri or None,
                "strategy": self.strategy,
                "budget": self.budget,
                "continuations": self.continuations,
                "iterations": self.iterations,
                "seed": self.seed,
                "output": "pipeline",
            }
        )
        return PipelineConfig(train, self.run_name, self.store_uri, self.ray_address)


# --- prep, and where the policy starts -------------------------------------------------------
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
    params: PipelineParameters, prompts_dir: Path, suite: TaskSuite | None = None
) -> PrepResult:
    """Validate the parameters into the run's config, write its prompts, decide the start."""
    from trace_core.envs.prompts import write_prompts
    from trace_core.envs.suites import make_suite

    config = params.config()
    train = config.train
    suite = suite or make_suite(train.task, train.data, train.seed)
    train_tasks = suite.tasks("train")
    eval_tasks = suite.tasks("eval")[: train.eval_tasks]
    write_prompts(prompts_dir / PROMPTS_TRAIN, train.task, train_tasks)
    write_prompts(prompts_dir / PROMPTS_EVAL, train.task, eval_tasks)
    start, done = ("load" if train.init else "warmstart"), 0
    if config.run_name:
        checkpoint = _registry(config).latest(config.run_name)
        if checkpoint is not None:
            start, done = "load", checkpoint.iteration
    return PrepResult(config.to_json(), start, done, len(train_tasks), len(eval_tasks))


def warmstart_step(
    config: PipelineConfig, policy_dir: Path, predictor_dir: Path
) -> dict[str, float]:
    """SFT of the synthetic task's tiny policy; the fresh predictor beside it."""
    from trace_core.policy.model import load_checkpoint
    from trace_core.train.iteration import new_predictor, warmstart_config
    from trace_core.train.warmstart import warmstart

    if config.train.task not in SYNTHETIC:
        raise ValueError(
            f"task {config.train.task!r} has no warm start: set base_model_uri "
            f"(warm starts exist for {', '.join(SYNTHETIC)})"
        )
    report = warmstart(warmstart_config(config.train, policy_dir))
    _, tokenizer = load_checkpoint(policy_dir)
    new_predictor(config.train, tokenizer).save(predictor_dir)
    success = list(report.success.values())
    metrics = {
        "warmstart_steps": float(report.steps),
        "warmstart_final_loss": report.final_loss,
        "warmstart_seconds": report.train_seconds,
        "warmstart_success": sum(success) / len(success) if success else 0.0,
    }
    _write_metrics(policy_dir, metrics)
    return metrics


def load_step(config: PipelineConfig, policy_dir: Path, predictor_dir: Path) -> dict[str, float]:
    """The starting policy and predictor: the run's latest registry checkpoint when it has
    one (resume), else the base model (``train.init``) and a fresh predictor."""
    from trace_core.policy.model import load_checkpoint
    from trace_core.store.sync import download_folder
    from trace_core.train.iteration import new_predictor

    checkpoint = _registry(config).latest(config.run_name) if config.run_name else None
    if checkpoint is not None:
        staging = policy_dir.parent / f".resume-{uuid.uuid4().hex[:8]}"
        _registry(config).download(checkpoint, staging)
        _move(staging / "policy", policy_dir)
        _move(staging / "predictor", predictor_dir)
        shutil.rmtree(staging)
        metrics = {"resumed_iteration": float(checkpoint.iteration)}
    elif config.train.init:
        source = str(config.train.init)
        if "://" in source and not source.startswith("file://"):
            download_folder(source, policy_dir)
        else:
            shutil.copytree(source.removeprefix("file://"), policy_dir, dirs_exist_ok=True)
        _, tokenizer = load_checkpoint(policy_dir)
        new_predictor(config.train, tokenizer).save(predictor_dir)
        metrics = {"resumed_iteration": 0.0}
    else:
        raise ValueError("nothing to load: no base_model_uri and no checkpoint of run_name")
    _write_metrics(policy_dir, metrics)
    return metrics


# --- one iteration ---------------------------------------------------------------------------
def rollout_step(
    config: PipelineConfig,
    iteration: int,
    prompts_dir: Path,
    policy_dir: Path,
    predictor_dir: Path,
    trees_dir: Path,
    suite: TaskSuite | None = None,
) -> dict[str, float]:
    """Grow iteration ``iteration``'s trees with the policy; ``trees_dir/trees.parquet``."""
    from trace_core.algo.metrics import measure
    from trace_core.envs.prompts import read_prompts
    from trace_core.envs.suites import make_suite
    from trace_core.policy.format import TurnFormat
    from trace_core.policy.model import load_checkpoint
    from trace_core.policy.torch_engine import TorchEngine
    from trace_core.policy.value import ValuePredictor
    from trace_core.store.schema import write_trees
    from trace_core.train.iteration import draw_iteration, roll_out

    train = config.train
    start = time.perf_counter()
    task, tasks = read_prompts(str(prompts_dir / PROMPTS_TRAIN))
    suite = suite or make_suite(task, train.data, train.seed)
    model, tokenizer = load_checkpoint(policy_dir)
    predictor = ValuePredictor.load(predictor_dir, tokenizer)
    draws = draw_iteration(train.seed, iteration, len(tasks), train.prompts)
    engine = TorchEngine(model, device=device())
    trees = roll_out(
        engine, TurnFormat(tokenizer), suite.make_env, tasks, predictor, train, iteration, draws,
        run_id=config.run_id,
    )  # fmt: skip
    trees_dir.mkdir(parents=True, exist_ok=True)
    write_trees(trees_dir / TREES, trees)
    (trees_dir / DRAWS).write_text(json.dumps({"iteration": iteration, **asdict(draws)}) + "\n")
    metrics = {
        "iteration": float(iteration),
        **measure(trees).as_dict(),
        "seconds": time.perf_counter() - start,
    }
    _write_metrics(trees_dir, metrics)
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
    from transformers import AutoTokenizer

    from trace_core.policy.value import ValuePredictor
    from trace_core.store.schema import read_trees
    from trace_core.train.iteration import fit_predictor

    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    predictor = ValuePredictor.load(predictor_dir, tokenizer)
    trees = read_trees(trees_dir / TREES)
    draws = _read_draws(trees_dir, iteration)
    fit = fit_predictor(predictor, trees, draws)
    predictor.save(predictor_out)
    metrics = {"iteration": float(iteration), **{k: float(v) for k, v in asdict(fit).items()}}
    _write_metrics(predictor_out, metrics)
    return metrics


def update_step(
    config: PipelineConfig,
    iteration: int,
    trees_dir: Path,
    policy_dir: Path,
    reference_dir: Path,
    policy_out: Path,
) -> dict[str, float]:
    """One policy update on this iteration's trees; the policy, its optimizer state and the
    log with this iteration's line go to ``policy_out``."""
    from trace_core.algo.metrics import measure
    from trace_core.policy.model import load_checkpoint, save_checkpoint
    from trace_core.policy.update import load_optimizer, make_optimizer, save_optimizer
    from trace_core.store.schema import read_trees
    from trace_core.train.iteration import update

    train = config.train
    start = time.perf_counter()
    trees = read_trees(trees_dir / TREES)
    draws = _read_draws(trees_dir, iteration)
    optimizer_path = policy_dir / OPTIMIZER
    if train.train_workers:
        from trace_core.train.ray_update import update_on_ray

        stats = update_on_ray(
            policy_dir,
            trees_dir / TREES,
            policy_out,
            train.update,
            draws.update_seed,
            train.train_workers,
            optimizer_path=optimizer_path if optimizer_path.exists() else None,
            reference_dir=reference_dir,
            address=_worker_address(config),
        )
        (policy_out / "update.json").unlink(missing_ok=True)  # the stats go to metrics.json
    else:
        model, tokenizer = load_checkpoint(policy_dir, device=device())
        optimizer = make_optimizer(model, train.update)
        if optimizer_path.exists():
            load_optimizer(optimizer, optimizer_path)
        reference = None
        if train.update.kl_coef > 0:
            reference = load_checkpoint(reference_dir, device=device())[0]
        stats = update(model, optimizer, trees, train, draws, tokenizer.pad_token_id, reference)
        save_checkpoint(model, tokenizer, policy_out)
        save_optimizer(optimizer, policy_out / OPTIMIZER)
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
    metrics = {"iteration": float(iteration), **stats.as_dict()}
    _write_metrics(policy_out, metrics)
    return metrics


# --- evaluate and report ---------------------------------------------------------------------
def evaluate_step(
    config: PipelineConfig,
    prompts_dir: Path,
    policy_dir: Path,
    predictor_dir: Path | None = None,
    suite: TaskSuite | None = None,
) -> dict[str, object]:
    """Held-out pass@1 and mean@k of the policy on the eval prompts. With ``predictor_dir``
    (the final evaluation) and a run name, the policy and predictor are then registered as
    the run's latest checkpoint, which the next run of that name resumes from."""
    from trace_core.envs.prompts import read_prompts
    from trace_core.envs.suites import make_suite
    from trace_core.policy.format import TurnFormat
    from trace_core.policy.model import load_checkpoint
    from trace_core.train.iteration import evaluate

    train = config.train
    task, tasks = read_prompts(str(prompts_dir / PROMPTS_EVAL))
    suite = suite or make_suite(task, train.data, train.seed)
    model, tokenizer = load_checkpoint(policy_dir)
    report = evaluate(model, TurnFormat(tokenizer), suite.make_env, tasks, train, device())
    history = read_log(policy_dir)
    result: dict[str, object] = {
        **report.as_dict(),
        "tokens": report.tokens,
        "iteration": history[-1].iteration if history else 0,
    }
    if predictor_dir is not None and config.run_name:
        result["checkpoint"] = _register(config, policy_dir, predictor_dir, history)
    return result


def report_step(
    config: PipelineConfig,
    trees_dir: Path,
    policy_dir: Path,
    start_eval: Mapping[str, object],
    final_eval: Mapping[str, object],
    html_path: Path,
    markdown_path: Path,
    sample: int = 6,
) -> None:
    """The run at a glance: an HTML view of a sample of the last trees, and a Markdown summary
    (accuracy before and after, one line per iteration, the head of the trees' Parquet)."""
    from trace_core.store.html import render_html
    from trace_core.store.schema import read_trees
    from trace_core.train.report import summary_markdown

    trees = read_trees(trees_dir / TREES)
    iteration = trees[0].info.iteration if trees else 0
    # The most contrastive trees first: the ones whose leaves hold both outcomes.
    shown = sorted(trees, key=lambda t: -_mixedness(t))[:sample]
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(
        render_html(shown, title=f"{config.run_id}: iteration {iteration} rollout trees")
    )
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(
        summary_markdown(
            title=f"TRACE run {config.run_id}",
            settings={
                "task": config.train.task,
                "strategy": config.train.strategy,
                "M (roots)": config.train.budget,
                "N (continuations)": config.train.continuations,
                "iterations": config.train.iterations,
                "seed": config.train.seed,
            },
            records=read_log(policy_dir),
            start_eval=start_eval,
            final_eval=final_eval,
            trees_path=trees_dir / TREES,
        )
    )


# --- step folders (what `trace-rl step` and the Argo containers pass) -----------------------
STEP_FOLDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prep": ((), ("prompts", "result")),
    "warmstart": ((), ("policy", "predictor")),
    "load": ((), ("policy", "predictor")),
    "rollout": (("prompts", "policy", "predictor"), ("trees",)),
    "fit-predictor": (("trees", "policy", "predictor"), ("predictor",)),
    "update": (("trees", "policy", "reference"), ("policy",)),
    "evaluate": (("prompts", "policy", "predictor"), ("result",)),  # predictor: final only
    "report": (("trees", "policy", "start_eval", "final_eval"), ("report",)),
}
"""Input and output folders of each ``trace-rl step`` (local paths or s3:// prefixes)."""
EVAL_FILE = "eval.json"


def check_step_folders(step: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> None:
    """The step exists and gets exactly its folders (evaluate's predictor is optional)."""
    if step not in STEP_FOLDERS:
        raise ValueError(f"step {step!r}: choose one of {', '.join(STEP_FOLDERS)}")
    wanted_in, wanted_out = STEP_FOLDERS[step]
    optional = {"predictor"} if step == "evaluate" else set()
    missing = sorted((set(wanted_in) - set(inputs) - optional) | (set(wanted_out) - set(outputs)))
    extra = sorted((set(inputs) - set(wanted_in)) | (set(outputs) - set(wanted_out)))
    if missing or extra:
        raise ValueError(
            f"step {step}: missing folder(s) {missing or '-'}, unknown {extra or '-'}; "
            f"it takes inputs {', '.join(wanted_in) or '-'} and outputs {', '.join(wanted_out)}"
        )


# --- running a step here or as a Ray job -----------------------------------------------------
@dataclass(frozen=True)
class StepCall:
    """One step with its folders: local paths, or URIs (``trace-rl step`` fetches those)."""

    step: str
    iteration: int = 0
    inputs: Mapping[str, str] = field(default_factory=dict)
    outputs: Mapping[str, str] = field(default_factory=dict)
    input_uris: Mapping[str, str] = field(default_factory=dict)
    """Where inputs already are in object storage (KFP artifact URIs): a Ray job reads them
    there instead of from an upload."""

    def __post_init__(self) -> None:
        if self.step not in RAY_STEPS:
            raise ValueError(f"step {self.step!r}: only {', '.join(RAY_STEPS)} run this way")
        check_step_folders(self.step, self.inputs, self.outputs)


def run_step(call: StepCall, config: PipelineConfig) -> dict[str, float]:
    """Run ``call`` here, or as a Ray job when the config has a Ray dashboard address; either
    way its outputs end up in the local output folders and its metrics are returned."""
    if config.ray_address:
        from trace_core.train.rayjob import submit_step

        submit_step(call, config)
    else:
        execute_step(call, config)
    first = next(iter(call.outputs.values()))
    return {k: float(v) for k, v in json.loads((Path(first) / METRICS).read_text()).items()}


def execute_step(call: StepCall, config: PipelineConfig) -> None:
    """Run ``call`` in this process; s3:// folders are fetched first and published after."""
    with _staged(call.step, call.inputs, call.outputs) as (local, out):
        match call.step:
            case "rollout":
                rollout_step(
                    config, call.iteration, local["prompts"], local["policy"],
                    local["predictor"], out["trees"],
                )  # fmt: skip
            case "update":
                update_step(
                    config, call.iteration, local["trees"], local["policy"],
                    local["reference"], out["policy"],
                )  # fmt: skip


@contextlib.contextmanager
def _staged(
    step: str, inputs: Mapping[str, str], outputs: Mapping[str, str]
) -> Iterator[tuple[dict[str, Path], dict[str, Path]]]:
    """Local folders for a step's folders: s3:// inputs are downloaded into a scratch folder;
    s3:// outputs are written there and uploaded once the step has succeeded."""
    from trace_core.store.sync import download_folder, upload_folder

    with tempfile.TemporaryDirectory(prefix=f"trace-{step}-") as scratch:
        local: dict[str, Path] = {}
        for name, uri in inputs.items():
            local[name] = Path(scratch, "in", name) if _is_remote(uri) else Path(uri)
            if _is_remote(uri):
                download_folder(uri, local[name])
        out = {
            name: Path(scratch, "out", name) if _is_remote(uri) else Path(uri)
            for name, uri in outputs.items()
        }
        yield local, out
        for name, uri in outputs.items():
            if _is_remote(uri):
                upload_folder(out[name], uri)


def execute_cli_step(
    step: str,
    iteration: int,
    inputs: Mapping[str, str],
    outputs: Mapping[str, str],
    config_json: str = "",
    params: Mapping[str, str] | None = None,
) -> None:
    """Run any step on folders or s3:// prefixes. ``prep`` takes the run parameters
    (``params``, as the UI gives them: strings) and writes ``config.json``, ``start`` and
    ``start_iteration`` into its ``result`` folder; every other step takes the config JSON."""
    check_step_folders(step, inputs, outputs)
    if step in RAY_STEPS:
        execute_step(
            StepCall(step, iteration, inputs, outputs), PipelineConfig.from_json(config_json)
        )
        return
    with _staged(step, inputs, outputs) as (local, out):
        for folder in out.values():
            folder.mkdir(parents=True, exist_ok=True)
        if step == "prep":
            result = prep_step(parse_parameters(params or {}), out["prompts"])
            (out["result"] / "config.json").write_text(result.config_json)
            (out["result"] / "start").write_text(result.start)
            (out["result"] / "start_iteration").write_text(str(result.start_iteration))
        else:
            config = PipelineConfig.from_json(config_json)
            match step:
                case "warmstart":
                    warmstart_step(config, out["policy"], out["predictor"])
                case "load":
                    load_step(config, out["policy"], out["predictor"])
                case "fit-predictor":
                    fit_predictor_step(
                        config, iteration, local["trees"], local["policy"],
                        local["predictor"], out["predictor"],
                    )  # fmt: skip
                case "evaluate":
                    report = evaluate_step(
                        config, local["prompts"], local["policy"], local.get("predictor")
                    )
                    (out["result"] / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
                case "report":
                    start, final = (
                        json.loads((local[name] / EVAL_FILE).read_text())
                        for name in ("start_eval", "final_eval")
                    )
                    report_step(
                        config, local["trees"], local["policy"], start, final,
                        out["report"] / "report.html", out["report"] / "summary.md",
                    )  # fmt: skip


# --- helpers ---------------------------------------------------------------------------------
def device() -> str:
    """Where a step samples and trains: the GPU when the step's pod (or Ray job) has one.
    Not yet validated on CUDA (the engine and the update are written device-agnostic and
    exercised on CPU); results match ``train.loop`` exactly only on the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_remote(uri: str) -> bool:
    return uri.startswith(("s3://", "minio://"))


def _worker_address(config: PipelineConfig) -> str | None:
    """Where Ray Train workers go: a step of a run with a Ray dashboard address executes inside
    the Ray job it was sent as, so its workers join that job's cluster (Ray sets RAY_ADDRESS
    for a job's driver); otherwise the train config's head, or Ray in this process."""
    if config.ray_address and os.environ.get("RAY_ADDRESS"):
        return "auto"
    return config.train.ray_address


def _write_metrics(folder: Path, metrics: Mapping[str, float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METRICS).write_text(json.dumps(dict(metrics), indent=2) + "\n")


def _read_draws(trees_dir: Path, iteration: int) -> IterationDraws:
    """The draws the rollout made (``draws.json`` beside the trees): fit and update take their
    seeds from there, so they need neither the prompts nor the generator's position."""
    from trace_core.train.iteration import IterationDraws

    path = trees_dir / DRAWS
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; these trees were not written by rollout_step")
    body = json.loads(path.read_text())
    draws = IterationDraws(
        pool=tuple(body["pool"]),
        grow_seed=int(body["grow_seed"]),
        fit_seed=int(body["fit_seed"]),
        update_seed=int(body["update_seed"]),
    )
    trees_iteration = int(body.get("iteration", iteration))
    if trees_iteration != iteration:
        raise ValueError(f"{path}: trees of iteration {trees_iteration}, expected {iteration}")
    return draws


def _mixedness(tree: object) -> float:
    from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, success_counts

    assert isinstance(tree, RolloutTree)
    leaves = float(leaf_counts(tree)[ROOT])
    wins = float(success_counts(tree)[ROOT])
    return min(wins, leaves - wins) / leaves if leaves else 0.0


def _move(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: the checkpoint has no {source.name}/ folder")
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)


def _registry(config: PipelineConfig) -> CheckpointRegistry:
    from trace_core.store.artifacts import open_store
    from trace_core.store.registry import CheckpointRegistry

    return CheckpointRegistry(open_store(config.store))


def _register(
    config: PipelineConfig,
    policy_dir: Path,
    predictor_dir: Path,
    history: list[IterationRecord],
) -> str:
    """Save policy/ and predictor/ as the run's latest checkpoint; returns its folder URI."""
    iteration = history[-1].iteration if history else 0
    with tempfile.TemporaryDirectory(prefix="trace-checkpoint-") as scratch:
        for name, source in (("policy", policy_dir), ("predictor", predictor_dir)):
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                link = Path(scratch, name, path.relative_to(source))
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path.resolve())
        registry = _registry(config)
        checkpoint = registry.save(
            config.run_name, iteration, scratch, metadata={"strategy": config.train.strategy}
        )
    return registry.store.uri(checkpoint.key)


def parse_parameters(params: Mapping[str, str]) -> PipelineParameters:
    """Run parameters from NAME=VALUE strings, converted to the fields' types."""
    fields = {f.name: f for f in dataclasses.fields(PipelineParameters)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"--param {', '.join(unknown)}: the pipeline has no such parameter")
    values: dict[str, object] = {}
    for name, text in params.items():
        if fields[name].type in ("int", int):
            try:
                values[name] = int(text)
            except ValueError:
                raise ValueError(f"--param {name}={text!r}: expected an integer") from None
        else:
            values[name] = text
    return PipelineParameters(**values)  # type: ignore[arg-type]
