"""The pipeline's contract, importable without torch: the run parameters a user sets, the one
config JSON every step receives, and each step's input and output folders with the files in
them. The KFP pipeline (``pipelines/trace_training.py``), the Argo workflows
(``pipelines/argo.py``), the components and ``trace-rl step`` all read it from here.

    params = PipelineParameters(task="calc", iterations=2, settings_json='{"budget": 16}')
    config = params.config()                              # validated; prep writes its JSON
    PipelineConfig.from_json(config.to_json()) == config
    StepCall("iterate", 1, {"prompts": ..., "state": ...}, {"trees": ..., "state": ...})

Folders (the KFP artifacts; local paths or s3:// prefixes):
    prompts/    train.parquet, eval.parquet (``envs.prompts``; eval holds the first eval_tasks)
    policy/     where the run's session starts: an HF checkpoint (warmstart), or load's
                reference.json naming the base model or the registry checkpoint's policy
                (``store.reference``: weights never travel between steps)
    optimizer/  optimizer.json (the iteration its state is after) + optimizer.safetensors
                (AdamW's moments) and master.safetensors, or, when resuming, a reference.json
                to the registry folder that holds them
    predictor/  a saved ``SharedPredictor`` (before the first fit: the run's fresh one)
    state/      the run's state between the session's steps (``train.steps.session``):
                state.json, log.jsonl, predictor/, tokenizer/ (open-session's: eval.json too)
    trees/      trees.parquet, draws.json (the iteration's random draws, ``train.draws``)
    result/     prep: config.json, start, start_iteration; close-session: eval.json
Each step also writes ``metrics.json`` (flat name → number) into its first output folder; that
file is how a step run as a Ray job reports back (``train.dispatch.run_step``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trace_core.envs.suites import SYNTHETIC
from trace_core.store.uri import check_run_name, is_remote
from trace_core.train.config import TrainConfig
from trace_core.train.draws import IterationDraws

PROMPTS_TRAIN = "train.parquet"
PROMPTS_EVAL = "eval.parquet"
TREES = "trees.parquet"
METRICS = "metrics.json"
DRAWS = "draws.json"
OPTIMIZER = "optimizer.safetensors"
OPTIMIZER_INFO = "optimizer.json"
EVAL_FILE = "eval.json"
CONFIG_FILE = "config.json"

STEP_FOLDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prep": ((), ("prompts", "result")),
    "warmstart": ((), ("policy", "predictor", "optimizer")),
    "load": ((), ("policy", "predictor", "optimizer")),
    "open-session": (("prompts", "policy", "predictor", "optimizer"), ("state",)),
    "iterate": (("prompts", "state"), ("trees", "state")),
    "close-session": (("state",), ("result",)),
    "report": (("trees", "state", "start_eval", "final_eval"), ("report",)),
}
"""Input and output folders of each step (what ``trace-rl step`` and the Argo containers pass)."""
RAY_STEPS = ("open-session", "iterate", "close-session")
"""The steps on the run's session (``train.steps.session``): they run as Ray jobs when the
pipeline has a Ray dashboard address (``ray_jobs_url``)."""


def check_gcs_address(address: str, field: str) -> None:
    """``address`` is empty, ``auto`` or HOST:PORT (a Ray head's GCS), not a dashboard URL."""
    if not address or address == "auto":
        return
    if address.startswith(("http://", "https://")):
        raise ValueError(
            f"{field} {address!r} is a Ray dashboard URL: {field} is the head's GCS address "
            "HOST:PORT (port 6379); a dashboard URL for Ray job submission goes in ray_jobs_url"
        )
    if not re.fullmatch(r"[\w.-]+:\d{1,5}", address, re.A):
        raise ValueError(f"{field} {address!r}: expected a Ray head's GCS address HOST:PORT")


def write_optimizer_info(folder: Path, iteration: int) -> None:
    """Mark ``folder`` as the optimizer state after ``iteration`` (an empty state before the
    first update: the folder is never empty, so object stores keep it)."""
    folder.mkdir(parents=True, exist_ok=True)
    has_state = (folder / OPTIMIZER).is_file()
    (folder / OPTIMIZER_INFO).write_text(
        json.dumps({"iteration": iteration, "state": OPTIMIZER if has_state else None}) + "\n"
    )


def check_step_folders(step: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> None:
    """The step exists and gets exactly its folders (evaluate's predictor is optional)."""
    if step not in STEP_FOLDERS:
        raise ValueError(f"step {step!r}: choose one of {', '.join(STEP_FOLDERS)}")
    wanted_in, wanted_out = STEP_FOLDERS[step]
    missing = sorted((set(wanted_in) - set(inputs)) | (set(wanted_out) - set(outputs)))
    extra = sorted((set(inputs) - set(wanted_in)) | (set(outputs) - set(wanted_out)))
    if missing or extra:
        raise ValueError(
            f"step {step}: missing folder(s) {missing or '-'}, unknown {extra or '-'}; "
            f"it takes inputs {', '.join(wanted_in) or '-'} and outputs {', '.join(wanted_out)}"
        )


@dataclass(frozen=True)
class StepCall:
    """One Ray-runnable step with its folders: local paths, or URIs (fetched by the step)."""

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
    ray_jobs_url: str = ""
    """A Ray dashboard address http://HEAD:8265: the steps that use Ray (``RAY_STEPS``) are
    submitted there as Ray jobs, whose drivers run on the cluster. Empty: they run in their own
    process, connected to ``train.ray_address`` (a GCS address), or with Ray in-process."""
    engine_name: str = ""
    """The run's session name: its kept engine actors are ``<name>-<i>``, its trainers
    ``<name>-trainer-<rank>`` (``train.steps.session``); set by prep, one per pipeline run."""
    tracking_uri: str = ""
    """An MLflow tracking server the run logs to (``train.tracking``); empty: the steps'
    ``MLFLOW_TRACKING_URI``, if set."""
    keep_checkpoints: int = 2
    """How many of the run's newest checkpoints the registry keeps: after each commit the
    older ones are deleted (``CheckpointRegistry.prune``)."""

    def __post_init__(self) -> None:
        if isinstance(self.keep_checkpoints, bool) or not isinstance(self.keep_checkpoints, int):
            raise ValueError(f"keep_checkpoints must be an integer, got {self.keep_checkpoints!r}")
        if self.keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}: the registry "
                "keeps at least the checkpoint a run resumes from"
            )
        if self.run_name:
            check_run_name(self.run_name, "run_name")
        if self.run_name and not self.store:
            raise ValueError(f"run_name {self.run_name!r} needs store_uri (where checkpoints go)")
        if self.ray_jobs_url:
            if not re.fullmatch(r"https?://[^/\s]+/?", self.ray_jobs_url):
                raise ValueError(
                    f"ray_jobs_url {self.ray_jobs_url!r}: expected the Ray dashboard address "
                    "http://HEAD:8265 (Ray job submission)"
                )
            if not is_remote(self.store):
                raise ValueError(
                    "ray_jobs_url needs store_uri to be an s3:// prefix: steps run as Ray jobs "
                    f"exchange their inputs and outputs there (got {self.store!r})"
                )
        check_gcs_address(self.train.ray_address or "", "ray_address")
        if self.tracking_uri and not re.fullmatch(r"[a-z][\w+.-]*:\S+|/\S*", self.tracking_uri):
            raise ValueError(
                f"mlflow_tracking_uri {self.tracking_uri!r}: expected an MLflow tracking URI "
                "(http://HOST:5000, file:///PATH, sqlite:///PATH)"
            )
        if self.engine_name and not re.fullmatch(r"[\w][\w.-]{0,99}", self.engine_name, re.A):
            raise ValueError(f"engine_name {self.engine_name!r}: letters, digits, '.', '_', '-'")

    def to_json(self) -> str:
        body = {
            "train": self.train.to_json(),
            "run_name": self.run_name,
            "store": self.store,
            "ray_jobs_url": self.ray_jobs_url,
            "keep_checkpoints": self.keep_checkpoints,
        }
        if self.engine_name:
            body["engine_name"] = self.engine_name
        if self.tracking_uri:
            body["tracking_uri"] = self.tracking_uri
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PipelineConfig:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config_json is not JSON: {err}") from None
        if not isinstance(body, dict) or not isinstance(body.get("train"), dict):
            raise ValueError("config_json: expected an object with a 'train' object")
        known = {
            "train",
            "run_name",
            "store",
            "ray_jobs_url",
            "engine_name",
            "tracking_uri",
            "keep_checkpoints",
        }
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"config_json: unknown field(s) {', '.join(unknown)}")
        return cls(
            train=TrainConfig.from_json(body["train"]),
            run_name=str(body.get("run_name", "")),
            store=str(body.get("store", "")),
            ray_jobs_url=str(body.get("ray_jobs_url", "")),
            engine_name=str(body.get("engine_name", "")),
            tracking_uri=str(body.get("tracking_uri", "")),
            keep_checkpoints=body.get("keep_checkpoints", 2),
        )

    @property
    def run_id(self) -> str:
        """The ``run_id`` of the trees this run grows."""
        return self.run_name or "pipeline"


def session_name(run_name: str, pipeline_run_id: str = "") -> str:
    """A run's session name (``PipelineConfig.engine_name``): ``<run_id>-<8 hex>``, the hex
    from the pipeline run's id (KFP's run id, a UUID: its first 8 hex digits; any other id:
    its hash's) when given, so the run's exit handler finds the session by the same id; else
    random. ``run_id``: ``run_name``, or ``pipeline`` (``PipelineConfig.run_id``)."""
    import hashlib
    import uuid

    tag = pipeline_run_id[:8].lower()
    if pipeline_run_id and not re.fullmatch(r"[0-9a-f]{8}", tag):
        tag = hashlib.sha256(pipeline_run_id.encode()).hexdigest()[:8]
    return f"{run_name or 'pipeline'}-{tag or uuid.uuid4().hex[:8]}"


def in_ray_job(config: PipelineConfig) -> bool:
    """Whether this is the Ray job a step of a run with ``ray_jobs_url`` was sent as (Ray sets
    RAY_ADDRESS for a job's driver), rather than the place that sends it."""
    return bool(config.ray_jobs_url and os.environ.get("RAY_ADDRESS"))


def worker_address(config: PipelineConfig) -> str | None:
    """Where the run's actors are: inside a step's Ray job, that job's cluster; otherwise the
    head at ``train.ray_address``, or (None) a Ray started in this process."""
    return "auto" if in_ray_job(config) else config.train.ray_address


# --- the run parameters: declared once, here -------------------------------------------------
@dataclass(frozen=True)
class PipelineParameters:
    """The pipeline's run parameters, as a user sets them in the KFP UI; prep turns them into
    the ``PipelineConfig``. The KFP pipeline's signature, the prep component's, the Argo
    workflow parameters and ``trace-rl run-local``'s flags are checked against (or built from)
    these fields (tests/pipelines/test_parameters.py)."""

    task: str = "calc"
    """calc, calc-mix, multihop, bfcl, deepscaler or hotpotqa."""
    dataset_uri: str = ""
    """Dataset path or URI of the loader tasks (deepscaler, hotpotqa)."""
    retriever_url: str = ""
    """A retrieval service http(s)://HOST:PORT (Search-R1's /retrieve) that multihop and
    hotpotqa search instead of their in-process BM25 (empty: in process)."""
    base_model_uri: str = ""
    """Starting policy: an HF directory or s3:// prefix; empty warm-starts calc/multihop."""
    strategy: str = "trace"
    """Allocation strategy: grpo, pcl, treepo, trace, trace-root, trace-prefix or trace-auto."""
    budget: int = 128
    """M: root rollouts per iteration of a tree strategy."""
    continuations: int = 2
    """N: continuations per root."""
    iterations: int = 4
    """K: training iterations of this run (after the one it resumes from)."""
    max_staleness: int = 1
    """k: how many policy versions older than the ones it updates an iteration's trees may
    be. 0: rollout, then update (synchronous); >= 1: the trees ahead grow on the engines while
    the trainers update (``train.phases``). 1 by default: on calc-mix it cost no accuracy a
    paired interval can see, and 2 did (docs/results.md, "Bounded staleness")."""
    seed: int = 0
    """Seed of pools, plans, sampling and updates."""
    checkpoint_every: int = 5
    """Write the policy, optimizer state and predictor to the registry every this many
    iterations (and after the last); in between they stay on the run's trainers."""
    keep_checkpoints: int = 2
    """How many of the run's newest checkpoints the registry keeps (>= 1): once a newer one is
    committed, older ones are deleted, never the latest (a Qwen3-8B checkpoint is ≈115 GB)."""
    ray_address: str = ""
    """A Ray head's GCS address HOST:PORT that the steps connect to: the run's trainer and
    engine actors live there across steps (empty: each step starts Ray in its own process)."""
    ray_jobs_url: str = ""
    """A Ray dashboard http://HEAD:8265 the Ray steps are submitted to as Ray jobs."""
    engine: str = "torch"
    """Rollout engine: torch, hf or vllm."""
    rollout_workers: int = 0
    """Ray engine actors of the rollout (0: one engine in the step's own process)."""
    gpus_per_worker: float = 0.0
    """GPUs each Ray engine actor asks for (with rollout_workers >= 1)."""
    run_name: str = ""
    """Checkpoint registry name: resume from its latest checkpoint, register the final one."""
    store_uri: str = ""
    """Registry and staging root (a path or s3://bucket/prefix)."""
    settings_json: str = "{}"
    """Any other TrainConfig field, as a JSON object (e.g. {"prompts": 256})."""
    mlflow_tracking_uri: str = ""
    """An MLflow tracking server (http://HOST:5000) to log the run to: its config, figures by
    iteration, report and plots (empty: the steps' MLFLOW_TRACKING_URI, if any)."""

    def config(self) -> PipelineConfig:
        try:
            settings = json.loads(self.settings_json or "{}")
        except json.JSONDecodeError as err:
            raise ValueError(f"settings_json is not JSON: {err}") from None
        if not isinstance(settings, dict):
            raise ValueError("settings_json must be a JSON object of TrainConfig fields")
        own = {
            "task", "data", "init", "strategy", "budget", "continuations", "iterations", "seed",
            "checkpoint_every", "max_staleness", "retriever_url", "keep_checkpoints",
        }  # fmt: skip
        clash = sorted(own & set(settings))
        if clash:
            raise ValueError(
                f"settings_json sets {', '.join(clash)}: use the pipeline parameter(s) instead"
            )
        if "output" in settings or "ray_address" in settings:
            raise ValueError("settings_json may not set output or ray_address")
        engine = settings.get("engine", {})
        if not isinstance(engine, dict):
            raise ValueError("settings_json's engine must be a JSON object of EngineConfig fields")
        clash = sorted(set(ENGINE_PARAMETERS) & set(engine))
        if clash:
            names = ", ".join(ENGINE_PARAMETERS[name] for name in clash)
            raise ValueError(
                f"settings_json's engine sets {', '.join(clash)}: use the pipeline parameter(s) "
                f"{names} instead"
            )
        engine = {
            **engine,
            "engine": self.engine,
            "workers": self.rollout_workers,
            "gpus_per_worker": float(self.gpus_per_worker),
        }
        if not self.base_model_uri and self.task not in SYNTHETIC:
            raise ValueError(
                f"task {self.task!r} has no built-in warm start: set base_model_uri "
                f"(warm starts exist for {', '.join(SYNTHETIC)})"
            )
        train = TrainConfig.from_json(
            {
                **settings,
                "engine": engine,
                "task": self.task,
                "data": self.dataset_uri or None,
                "retriever_url": self.retriever_url.strip() or None,
                "init": self.base_model_uri or None,
                "strategy": self.strategy,
                "budget": self.budget,
                "continuations": self.continuations,
                "iterations": self.iterations,
                "max_staleness": self.max_staleness,
                "seed": self.seed,
                "checkpoint_every": self.checkpoint_every,
                "ray_address": self.ray_address or None,
                "output": "pipeline",
            }
        )
        return PipelineConfig(
            train, self.run_name, self.store_uri, self.ray_jobs_url,
            tracking_uri=self.mlflow_tracking_uri.strip(),
            keep_checkpoints=self.keep_checkpoints,
        )  # fmt: skip


ENGINE_PARAMETERS = {
    "engine": "engine",
    "workers": "rollout_workers",
    "gpus_per_worker": "gpus_per_worker",
}
"""``EngineConfig`` fields that are pipeline parameters of their own → the parameter's name."""


def parse_parameters(params: Mapping[str, str]) -> PipelineParameters:
    """Run parameters from NAME=VALUE strings (the UI's, Argo's), converted to the fields' types."""
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
        elif fields[name].type in ("float", float):
            try:
                values[name] = float(text)
            except ValueError:
                raise ValueError(f"--param {name}={text!r}: expected a number") from None
        else:
            values[name] = text
    return PipelineParameters(**values)  # type: ignore[arg-type]


# --- small files inside the folders ----------------------------------------------------------
def write_metrics(folder: Path, metrics: Mapping[str, float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METRICS).write_text(json.dumps(dict(metrics), indent=2) + "\n")


def read_metrics(folder: Path) -> dict[str, float]:
    return {k: float(v) for k, v in json.loads((folder / METRICS).read_text()).items()}


def write_draws(trees_dir: Path, iteration: int, draws: IterationDraws) -> None:
    body = {"iteration": iteration, **dataclasses.asdict(draws)}
    (trees_dir / DRAWS).write_text(json.dumps(body) + "\n")
