"""The local training loop: warm start, then K × (rollout → fit predictor → update policy),
evaluating on the held-out split as it goes.

    trace-rl train --task calc --strategy trace --iterations 12 --output build/train/calc-trace

Each iteration draws a fresh prompt pool from the train split, grows one budgeted tree per
rolled-out prompt with the current policy (``rollout.grow``), refits the shared predictor on
every tree seen so far, and takes a policy-gradient step on the new trees
(``policy.update``). An iteration is committed when its directory is complete:

    OUTPUT/
      config.json                  the run's config (what ``--resume`` checks against)
      log.jsonl                    one line per iteration: rollout metrics, update stats, eval
      curves.png                   held-out accuracy and effective ratio vs generated tokens
      warmstart/                   the warm-started policy (synthetic tasks without --init)
      iterations/0003/
        trees.parquet  metrics.json
        policy/                    HF checkpoint (loads in TorchEngine and vLLM)
        optimizer.safetensors      AdamW moments, so a resumed run continues the same update
        predictor/                 the success predictor after this iteration's fit
      latest                       the last complete iteration, written last (atomic rename)

A run started again with the same output folder resumes after ``latest``: the crash of an
iteration half-way leaves ``latest`` on the one before, whose files are whole. Every random
draw of iteration i comes from a generator seeded by (seed, i), so a resumed run samples what
an uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from trace_core.algo.metrics import measure
from trace_core.algo.plan import Budget, strategy
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import TaskSuite
from trace_core.envs.suites import make_suite
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import load_checkpoint, save_checkpoint
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import (
    UpdateConfig,
    UpdateStats,
    load_optimizer,
    make_optimizer,
    save_optimizer,
)
from trace_core.policy.value import ValuePredictor
from trace_core.store.schema import write_trees
from trace_core.train import iteration
from trace_core.train.evaluate import ALL, EvalReport
from trace_core.train.warmstart import warmstart

LATEST = "latest"
PREDICTOR = "predictor"


@dataclass(frozen=True)
class TrainConfig:
    task: str = "calc"
    """Task suite: calc, multihop, bfcl, deepscaler or hotpotqa."""
    data: str | None = None
    """Dataset path or URI of the loader tasks."""
    output: Path = Path("build/train/calc-trace")
    """Run folder: checkpoints, trees, log, plot (see the module docstring)."""
    init: Path | str | None = None
    """Policy to start from (HF directory; in the pipeline also an s3:// URI); None warm-starts
    the tiny policy (calc, multihop)."""
    strategy: str = "trace"
    """Allocation strategy: grpo, pcl, treepo, trace, trace-root or trace-prefix."""
    iterations: int = 12
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
    seed: int = 0
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval_tasks: int = 300
    """Held-out tasks evaluated (the first ones of the eval split)."""
    eval_k: int = 4
    """Samples per task for mean@k."""
    eval_every: int = 2
    """Evaluate after every this many iterations (and before the first, and after the last)."""
    warmstart_steps: int = 1000
    """SFT steps of the warm start (when ``init`` is None)."""
    predictor: str = "hashed"
    """Featurizer of the shared success predictor: hashed (token n-grams) or embedding."""
    train_workers: int = 0
    """Ray Train workers for the policy update (0: in this process)."""
    ray_address: str | None = None
    """Ray head for ``train_workers`` (default: Ray started in this process)."""

    def __post_init__(self) -> None:
        if strategy(self.strategy).uses_true_value:
            raise ValueError(f"strategy {self.strategy!r} needs the true V: simulator only")
        Budget(self.budget, self.continuations, self.group)  # validates
        if self.iterations < 1 or self.prompts < 1 or self.eval_every < 1:
            raise ValueError("iterations, prompts and eval_every must be >= 1")
        if self.predictor not in ("hashed", "embedding"):
            raise ValueError(f"predictor must be hashed or embedding, got {self.predictor!r}")
        if self.train_workers < 0:
            raise ValueError(f"train_workers must be >= 0, got {self.train_workers}")
        if self.eval_tasks < 1 or self.eval_k < 0:
            raise ValueError("eval_tasks must be >= 1 and eval_k >= 0")
        if self.init is None and self.task not in ("calc", "multihop"):
            raise ValueError(
                f"task {self.task!r} has no built-in warm start: pass a policy with --init"
            )

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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown train config field(s): {', '.join(unknown)}")
        values = dict(data)
        defaults = cls()
        for name, value in values.items():
            default = getattr(defaults, name)
            if isinstance(default, bool | int | float) and not _same_kind(value, default):
                raise ValueError(
                    f"train config field {name!r}: expected {type(default).__name__}, got {value!r}"
                )
        if "output" in values:
            values["output"] = Path(str(values["output"]))
        if isinstance(values.get("update"), dict):
            update = values["update"]
            extra = sorted(set(update) - {f.name for f in fields(UpdateConfig)})
            if extra:
                raise ValueError(f"unknown update config field(s): {', '.join(extra)}")
            values["update"] = UpdateConfig(**update)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except TypeError as err:
            raise ValueError(f"train config: {err}") from None


@dataclass(frozen=True)
class IterationRecord:
    """One line of ``log.jsonl``."""

    iteration: int
    """0 is the starting policy (evaluation only); training iterations count from 1."""
    strategy: str
    tokens: int
    """Generated rollout tokens of this iteration."""
    total_tokens: int
    """Generated rollout tokens of every iteration up to this one."""
    rollout: dict[str, float]
    update: dict[str, float]
    eval: dict[str, object] | None
    seconds: dict[str, float]
    predictor: dict[str, float] = field(default_factory=dict)
    """The predictor fit: rows, replayed rows, weighted MSE before and after."""


def train(
    config: TrainConfig,
    progress: Callable[[str], None] | None = None,
    suite: TaskSuite | None = None,
) -> list[IterationRecord]:
    """Run (or resume) the loop; returns every iteration's record, the resumed ones included.

    ``suite`` replaces the one ``config.task`` names (tests bring their own envs).
    """
    say = progress or (lambda _message: None)
    out = config.output
    out.mkdir(parents=True, exist_ok=True)
    _check_config(out, config)
    suite = suite or make_suite(config.task, config.data, config.seed)
    done = read_latest(out)
    if done:
        policy_dir = iteration_dir(out, done) / "policy"
        say(f"resuming after iteration {done} from {policy_dir}")
    elif config.init:
        policy_dir = Path(config.init)
    else:
        policy_dir = out / "warmstart"
        if not (policy_dir / "config.json").exists():
            say(f"warm start of the {config.task} policy")
            warmstart(iteration.warmstart_config(config, policy_dir))
    model, tokenizer = load_checkpoint(policy_dir)
    reference = None
    if config.update.kl_coef > 0:  # KL to the policy the run started from, resumed or not
        reference, _ = load_checkpoint(Path(config.init or out / "warmstart"))
    fmt = TurnFormat(tokenizer)
    optimizer = make_optimizer(model, config.update)
    predictor = iteration.new_predictor(config, tokenizer)
    records = read_log(out)[: done + 1] if done else []
    if done:
        load_optimizer(optimizer, iteration_dir(out, done) / "optimizer.safetensors")
        predictor = ValuePredictor.load(iteration_dir(out, done) / PREDICTOR, tokenizer)
    eval_tasks = iteration.eval_tasks(suite, config)
    if not records:
        say("evaluating the starting policy")
        report = iteration.evaluate(model, fmt, suite.make_env, eval_tasks, config)
        records = [IterationRecord(0, config.strategy, 0, 0, {}, {}, _eval_dict(report), {})]
        _append_log(out, records[0], fresh=True)
    train_tasks = suite.tasks("train")
    for i in range(done + 1, config.iterations + 1):
        draws = iteration.draw_iteration(config.seed, i, len(train_tasks), config.prompts)
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        trees = iteration.roll_out(
            TorchEngine(model),
            fmt,
            suite.make_env,
            train_tasks,
            predictor,
            config,
            i,
            draws,
            run_id=out.name,
        )
        seconds["rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        fit = iteration.fit_predictor(predictor, trees, draws)
        seconds["predictor"] = time.perf_counter() - start
        start = time.perf_counter()
        if config.train_workers:
            stats = _update_on_ray(
                config, out, i, policy_dir, trees, draws.update_seed, model, optimizer
            )
        else:
            stats = iteration.update(
                model, optimizer, trees, config, draws, tokenizer.pad_token_id, reference
            )
        seconds["update"] = time.perf_counter() - start
        report = None
        if i % config.eval_every == 0 or i == config.iterations:
            start = time.perf_counter()
            report = iteration.evaluate(model, fmt, suite.make_env, eval_tasks, config)
            seconds["eval"] = time.perf_counter() - start
        metrics = measure(trees)
        record = IterationRecord(
            iteration=i,
            strategy=config.strategy,
            tokens=metrics.tokens,
            total_tokens=records[-1].total_tokens + metrics.tokens,
            rollout=metrics.as_dict(),
            update=stats.as_dict(),
            eval=_eval_dict(report) if report else None,
            seconds=seconds,
            predictor={k: float(v) for k, v in asdict(fit).items()},
        )
        _commit_iteration(out, i, model, tokenizer, optimizer, predictor, trees, record)
        policy_dir = iteration_dir(out, i) / "policy"
        records.append(record)
        accuracy = f", mean@{config.eval_k} {report.mean_k[ALL]:.3f}" if report else ""
        say(
            f"iteration {i}/{config.iterations}: {metrics.tokens:,} tokens, prompt effective "
            f"ratio {metrics.prompt_effective_ratio:.2f}{accuracy}"
        )
    return records


# --- run folder --------------------------------------------------------------------------
def iteration_dir(out: Path, i: int) -> Path:
    return out / "iterations" / f"{i:04d}"


def read_latest(out: Path) -> int:
    """The last complete iteration (0 when none is)."""
    path = out / LATEST
    if not path.exists():
        return 0
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def read_log(out: Path) -> list[IterationRecord]:
    path = out / "log.jsonl"
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            records.append(IterationRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"{path}, line {n}: not an iteration record ({err})") from None
    return records


def _check_config(out: Path, config: TrainConfig) -> None:
    """Write config.json on a new run; on a resumed one, refuse a different config."""
    path = out / "config.json"
    current = config.to_json()
    if path.exists() and read_latest(out):
        stored = json.loads(path.read_text())
        changed = sorted(
            k for k in current if k not in ("iterations", "output") and stored.get(k) != current[k]
        )
        if changed:
            raise ValueError(
                f"{out} holds a run with a different config ({', '.join(changed)}); "
                "use another --output or the same settings"
            )
    _write_atomic(path, json.dumps(current, indent=2) + "\n")


def _commit_iteration(
    out: Path,
    i: int,
    model: torch.nn.Module,
    tokenizer: object,
    optimizer: torch.optim.Optimizer,
    predictor: ValuePredictor,
    trees: Sequence[RolloutTree],
    record: IterationRecord,
) -> None:
    """Write iteration i's folder in full, then the log line, then move ``latest``."""
    final = iteration_dir(out, i)
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_trees(staging / "trees.parquet", trees)
    (staging / "metrics.json").write_text(json.dumps(record.rollout, indent=2) + "\n")
    save_checkpoint(model, tokenizer, staging / "policy")  # type: ignore[arg-type]
    save_optimizer(optimizer, staging / "optimizer.safetensors")
    predictor.save(staging / PREDICTOR)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    _append_log(out, record)
    _write_atomic(out / LATEST, f"{i}\n")


def _append_log(out: Path, record: IterationRecord, fresh: bool = False) -> None:
    """Rewrite the log up to this record's iteration (a crashed run may have left a later line)."""
    path = out / "log.jsonl"
    kept = [] if fresh else [r for r in read_log(out) if r.iteration < record.iteration]
    lines = [json.dumps(asdict(r)) for r in [*kept, record]]
    _write_atomic(path, "\n".join(lines) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- pieces ------------------------------------------------------------------------------
def _update_on_ray(
    config: TrainConfig,
    out: Path,
    i: int,
    policy_dir: Path,
    trees: Sequence[RolloutTree],
    seed: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> UpdateStats:
    """The same update on Ray Train workers, loaded back into ``model`` and ``optimizer``."""
    from trace_core.train.ray_update import OPTIMIZER, update_on_ray

    staging = iteration_dir(out, i).with_name(f"{i:04d}.update")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_trees(staging / "trees.parquet", trees)
    previous = iteration_dir(out, i - 1) / "optimizer.safetensors"
    stats = update_on_ray(
        policy_dir,
        staging / "trees.parquet",
        staging / "policy",
        config.update,
        seed,
        config.train_workers,
        optimizer_path=previous if i > 1 else None,
        reference_dir=Path(config.init or out / "warmstart"),
        address=config.ray_address,
    )
    updated, _ = load_checkpoint(staging / "policy")
    model.load_state_dict(updated.state_dict())  # same Parameter objects: the optimizer's
    load_optimizer(optimizer, staging / "policy" / OPTIMIZER)
    shutil.rmtree(staging)
    return stats


def _eval_dict(report: EvalReport) -> dict[str, object]:
    return {**report.as_dict(), "tokens": report.tokens}


def plot_run(records: Sequence[IterationRecord], path: Path) -> None:
    """Held-out accuracy and the prompt effective ratio against generated rollout tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in records if r.eval]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    tokens = [r.total_tokens / 1000 for r in evals]
    for key, label in (("mean_k", "mean@k"), ("pass1", "pass@1 (greedy)")):
        left.plot(tokens, [r.eval[key][ALL] for r in evals], marker="o", label=label)  # type: ignore[index]
    left.set(xlabel="generated rollout tokens (thousands)", ylabel="held-out success")
    trained = records[1:]
    right.plot(
        [r.total_tokens / 1000 for r in trained],
        [r.rollout["prompt_effective_ratio"] for r in trained],
        marker=".",
    )
    right.set(
        xlabel="generated rollout tokens (thousands)",
        ylabel="prompt effective ratio",
        ylim=(0, 1.02),
    )
    strategy_name = records[0].strategy if records else ""
    fig.suptitle(f"{strategy_name}: held-out accuracy and reward contrast")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _same_kind(value: object, default: bool | int | float) -> bool:
    """JSON's number kinds against a field's: an int is a float, a bool is neither."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, int):
        return isinstance(value, int)
    return isinstance(value, int | float)
