"""The training run's settings: one frozen dataclass, validated on construction, serialised to
the JSON that ``trace-rl train`` keeps beside a run and every pipeline step receives.

    config = TrainConfig(task="calc", strategy="trace", budget=64, engine=EngineConfig(workers=2))
    TrainConfig.from_json(config.to_json()) == config

Importable without torch: the pipeline definitions and the KFP components carry it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from trace_core.algo.plan import Budget, strategy
from trace_core.envs.remote import check_retriever_url
from trace_core.envs.suites import RETRIEVAL, SYNTHETIC
from trace_core.policy.update_config import UpdateConfig
from trace_core.rollout.engine_config import EngineConfig


@dataclass(frozen=True)
class TrainConfig:
    task: str = "calc"
    """Task suite: calc, calc-mix, multihop, bfcl, deepscaler or hotpotqa."""
    data: str | None = None
    """Dataset path or URI of the loader tasks."""
    retriever_url: str | None = None
    """A retrieval service http(s)://HOST:PORT (Search-R1's /retrieve) that multihop and
    hotpotqa search instead of their in-process BM25; empty: in process."""
    output: Path = Path("build/train/calc-trace")
    """Run folder: checkpoints, trees, log, plot (see the module docstring)."""
    init: Path | str | None = None
    """Policy to start from: an HF directory or an s3:// prefix (downloaded once into the run's
    ``init/``); None warm-starts the tiny policy (calc, calc-mix, multihop)."""
    warmstart_init: bool = False
    """Fine-tune ``init`` on the task's reference solutions before the first iteration, so a
    pretrained model learns the action grammar (``train.warmstart``; calc, calc-mix, multihop)."""
    strategy: str = "trace"
    """Allocation strategy: grpo, pcl, treepo, trace, trace-root, trace-prefix or trace-auto."""
    iterations: int = 12
    """K: rollout → fit predictor → update iterations."""
    budget: int = 128
    """M: root rollouts per iteration of a tree strategy; every strategy spends M(1 + N/2) units."""
    continuations: int = 2
    """N: continuations per root."""
    group: int = 8
    """Group size of the fixed-group strategies (grpo, pcl)."""
    prompts: int = 512
    """Candidate prompts drawn from the train split each iteration."""
    max_tokens: int = 48
    """Generated tokens per turn at most."""
    thinking: bool = False
    """Qwen3-family thinking: ``enable_thinking`` of the chat template (``policy.format``)."""
    seed: int = 0
    """Seed of pools, plans, sampling and updates."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval_tasks: int = 300
    """Held-out tasks evaluated (the first ones of the eval split)."""
    eval_k: int = 4
    """Samples per task for mean@k."""
    eval_every: int = 2
    """Evaluate after every this many iterations (and before the first, and after the last)."""
    warmstart_steps: int = 0
    """SFT steps of the warm start (of the tiny policy, or of ``init`` with ``warmstart_init``);
    0: the task's (2000 for calc-mix, whose easiest level then saturates; else 1000)."""
    predictor: str = "hashed"
    """Featurizer of the shared success predictor: hashed (token n-grams) or embedding."""
    train_workers: int = 0
    """Trainer actors holding the policy and its optimizer state (0: in this process)."""
    train_gpus: bool = False
    """Each trainer actor takes one GPU (NCCL between them): train_workers = GPUs used, all on
    one node (at most ``engine.gpus_per_node``: ``rollout.placement``)."""
    train_fsdp: bool = False
    """Shard the policy, its gradients and AdamW's moments across the trainer actors (FSDP)
    instead of replicating them (DDP): for policies whose replicas do not fit."""
    wait_timeout_s: float = 3600.0
    """How long the driver waits for the trainer actors to answer a call (start, update,
    checkpoint) before it stops the run with one line naming them: an actor alive but stuck (a
    hung NCCL call, a frozen node) would hang it forever. 1 h: an 8B update takes about two
    minutes, its checkpoint's upload a few (``engine.call_timeout_s`` bounds the engines')."""
    checkpoint_every: int = 5
    """Write the policy, its optimizer state and master weights every this many iterations and
    after the last (the iterations between keep their trees, metrics and predictor); a resumed
    run goes on from the newest checkpoint. Between checkpoints the engines get new weights by
    a broadcast, not a file. 5: an 8B checkpoint is then 8% of a resident iteration
    (``bench iteration-cost``)."""
    max_staleness: int = 0
    """k: how many policy versions older than the weights an update starts from its trees may
    be. 0: roll out, then update (synchronous). k >= 1: the trees of iteration i + k grow while
    iteration i updates, on the weights of iteration i - 1 (the engines' weights change only
    between rollouts), and the update takes the off-policy correction (``objective``)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine: kind, Ray engine workers and their GPUs (``rollout.engine_config``)."""
    ray_address: str | None = None
    """Ray head (host:port) of ``train_workers`` and engine workers (default: Ray started in
    this process)."""

    def __post_init__(self) -> None:
        if strategy(self.strategy).uses_true_value:
            raise ValueError(f"strategy {self.strategy!r} needs the true V: simulator only")
        try:
            Budget(self.budget, self.continuations, self.group)
        except ValueError as err:
            raise ValueError(
                f"budget {self.budget}, continuations {self.continuations}, group {self.group}: "
                f"{err}"
            ) from None
        for name in ("iterations", "prompts", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.predictor not in ("hashed", "embedding"):
            raise ValueError(f"predictor must be hashed or embedding, got {self.predictor!r}")
        if self.train_workers < 0:
            raise ValueError(f"train_workers must be >= 0, got {self.train_workers}")
        if self.train_gpus and not self.train_workers:
            raise ValueError("train_gpus needs train_workers >= 1 (one trainer actor per GPU)")
        if self.train_fsdp and not self.train_workers:
            raise ValueError("train_fsdp needs train_workers >= 1 (the ranks it shards across)")
        if self.train_gpus and self.train_workers > self.engine.gpus_per_node:
            raise ValueError(
                f"train_workers {self.train_workers} with train_gpus: the trainers share one "
                f"node (one placement-group bundle: NCCL over NVLink and shared memory), and the "
                f"largest GPU pod has {self.engine.gpus_per_node} (engine.gpus_per_node): lower "
                f"train_workers, or raise gpus_per_node with the pods' GPUs"
            )
        if not self.wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        for name in ("eval_tasks", "eval_k", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness and self.update.old_logprobs == "engine":
            raise ValueError(
                f"max_staleness {self.max_staleness}: the update's ratio is then taken against "
                "the trainers' own recomputed π_old (the proximal policy), so old_logprobs must "
                "be auto or recompute, not engine"
            )
        if self.warmstart_steps < 0:
            steps = self.warmstart_steps
            raise ValueError(f"warmstart_steps must be >= 0 (0: the task's), got {steps}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.retriever_url:
            check_retriever_url(self.retriever_url)
            if self.task not in RETRIEVAL:
                raise ValueError(
                    f"retriever_url {self.retriever_url!r}: task {self.task!r} searches no "
                    f"passages (only {' and '.join(RETRIEVAL)} do); leave it empty"
                )
        if self.init is None and self.task not in SYNTHETIC:
            raise ValueError(
                f"task {self.task!r} has no built-in warm start: pass a policy with --init "
                f"(warm starts exist for {', '.join(SYNTHETIC)})"
            )
        if self.warmstart_init and (self.init is None or self.task not in SYNTHETIC):
            raise ValueError(
                "warmstart_init fine-tunes --init on the task's reference solutions: it needs "
                f"--init and a task with them ({', '.join(SYNTHETIC)}), got init {self.init}, "
                f"task {self.task!r}"
            )

    def objective(self) -> UpdateConfig:
        """The update the run's iterations make: ``update``, with the off-policy correction
        when trees may be stale (``max_staleness`` >= 1): the decoupled objective, the clipped
        ratio against the proximal policy (the trainers' weights before the update,
        recomputed) and each token weighted by proximal over behaviour probability (the
        engine's logprobs), truncated at ``tis_cap``, or at ``STALE_TIS_CAP`` when it is 0."""
        if self.max_staleness and not self.update.tis_cap:
            return replace(self.update, tis_cap=STALE_TIS_CAP)
        return self.update

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["output"] = str(self.output)
        out["init"] = str(self.init) if self.init else None
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> TrainConfig:
        """The config ``to_json`` wrote; an unknown or mistyped field is named in the error."""
        if not isinstance(data, dict):
            raise ValueError(f"a train config is a JSON object, got {type(data).__name__}")
        values = _checked(cls, "train", data)
        if "output" in values:
            values["output"] = Path(str(values["output"]))
        for name, kind in (("update", UpdateConfig), ("engine", EngineConfig)):
            if isinstance(values.get(name), dict):
                values[name] = kind(**_checked(kind, name, values[name]))  # type: ignore[arg-type]
        try:
            return cls(**values)  # type: ignore[arg-type]
        except TypeError as err:
            raise ValueError(f"train config: {err}") from None


STALE_TIS_CAP = 2.0
"""The truncation of the behaviour weight when ``max_staleness`` >= 1 and ``tis_cap`` is 0:
Yao et al.'s C = 2."""

PRETRAINED = {"lr": 1e-6, "max_tokens": 256, "micro_tokens": 4096, "warmstart_steps": 40}
"""Where a run from a pretrained model departs from the tiny policy's defaults. lr: RL
fine-tuning of 1–8B instruct models runs at about 1e-6 (DAPO, Dr. GRPO, the paper's setups); the
tiny model's 1e-4, tuned on a 370k-parameter model trained from scratch, would wreck a pretrained
one in a few steps. max_tokens: a real model writes a thought before its action; 48 tokens fit
the tiny model's one-line actions only. micro_tokens: a 135M model's unbatched update over a few
dozen paths of real turns holds tens of GB of activations; 4,096 tokens per pass keeps it to a
few GB (``trace-rl bench update``). warmstart_steps: with ``warmstart_init``, the short SFT of
``train.warmstart.PRETRAINED_SFT`` (the tiny policy's 1,000 steps learn the task from scratch)."""


TASK_WARMSTART_STEPS = {"calc-mix": 2000}
"""Warm-start SFT steps of a task whose regime needs other than ``DEFAULT_WARMSTART_STEPS``."""
DEFAULT_WARMSTART_STEPS = 1000


def warmstart_steps(config: TrainConfig) -> int:
    """The warm start's SFT steps: the config's, or (0) its task's."""
    return config.warmstart_steps or TASK_WARMSTART_STEPS.get(config.task, DEFAULT_WARMSTART_STEPS)


def with_pretrained_defaults(
    config: TrainConfig, explicit: Collection[str]
) -> tuple[TrainConfig, list[str]]:
    """``config`` with ``PRETRAINED``'s values for the fields not in ``explicit`` (the ones the
    user set), and a line per change saying so."""
    notes = []
    update, max_tokens, steps = config.update, config.max_tokens, config.warmstart_steps
    if "lr" not in explicit:
        update = replace(update, lr=PRETRAINED["lr"])
        notes.append(f"lr {PRETRAINED['lr']:g} (tiny policy: {UpdateConfig().lr:g})")
    if "micro_tokens" not in explicit:
        update = replace(update, micro_tokens=int(PRETRAINED["micro_tokens"]))
        notes.append(f"micro_tokens {update.micro_tokens} (tiny policy: 0, one pass)")
    if "max_tokens" not in explicit:
        max_tokens = int(PRETRAINED["max_tokens"])
        notes.append(f"max_tokens {max_tokens} (tiny policy: {TrainConfig().max_tokens})")
    if config.warmstart_init and "warmstart_steps" not in explicit:
        steps = int(PRETRAINED["warmstart_steps"])
        notes.append(f"warmstart_steps {steps} (tiny policy: {DEFAULT_WARMSTART_STEPS})")
    changed = replace(config, update=update, max_tokens=max_tokens, warmstart_steps=steps)
    return changed, notes


def _checked(kind: type, name: str, values: dict[str, object]) -> dict[str, object]:
    """``values`` if every key is a field of ``kind`` and every number has the field's kind;
    else a ValueError naming the ``name`` config's field."""
    extra = sorted(set(values) - {f.name for f in fields(kind)})
    if extra:
        raise ValueError(f"unknown {name} config field(s): {', '.join(extra)}")
    defaults = kind()
    for key, value in values.items():
        default = getattr(defaults, key)
        if isinstance(default, bool | int | float) and not _same_kind(value, default):
            raise ValueError(
                f"{name} config field {key!r}: expected {type(default).__name__}, got {value!r}"
            )
    return dict(values)


def _same_kind(value: object, default: bool | int | float) -> bool:
    """JSON's number kinds against a field's: an int is a float, a bool is neither."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, int):
        return isinstance(value, int)
    return isinstance(value, int | float)


def is_builtin_tiny(policy: Path) -> bool:
    """Whether ``policy`` (a checkpoint folder) is the built-in tiny policy or one trained from
    it: its tokenizer is the project's word-level one (``policy.tokenizer``)."""
    try:
        model = json.loads((Path(policy) / "tokenizer.json").read_text()).get("model", {})
    except (OSError, ValueError):
        return False
    return isinstance(model, dict) and model.get("type") == "WordLevel"


def check_update_place(ray_address: str | None, train_workers: int, policy: Path) -> None:
    """Refuse an update of a real model that would run where the step runs because
    ``train_workers`` is 0 although a Ray cluster is there (``ray_address``): in the pipeline
    that is the Ray head's CPU, hours for one update of a pretrained model. The built-in tiny
    policy updates in seconds anywhere."""
    if ray_address and not train_workers and not is_builtin_tiny(policy):
        raise ValueError(
            f"train_workers is 0 with ray_address {ray_address} set: the update of {policy} "
            "(not the built-in tiny policy) would run on this process's CPU (in a pipeline, the "
            "Ray head's); set train_workers to the GPUs to train on (--train-workers N "
            '--train-gpus, or {"train_workers": N, "train_gpus": true} in settings_json)'
        )
