"""TRACE against the baselines at equal budget: the same warm-started policy, seeds and rollout
units per iteration for every strategy; then the paper-style table, a plot and a JSON.

    trace-rl compare --task calc --seeds 3 --iterations 12 --budget 128 --json build/compare.json

Every (strategy, seed) pair is one ``train`` run in ``OUTPUT/STRATEGY/seed-S`` (so a stopped
comparison resumes where it was, and comparisons into one ``OUTPUT`` share the runs they have
in common), started from one warm start in ``OUTPUT/warmstart``. Runs
go ``parallel`` at a time, each in its own process with its share of the cores.

Reported per strategy, as the mean over seeds with its 95% Student-t interval (the JSON:
metric → {mean, std, lo, hi, n}; std with ddof 1):

- ``accuracy``: held-out mean@k after the last iteration (k samples per task, temperature 1);
  ``pass1``: greedy success, same tasks;
- ``prompt_effective_ratio`` (the paper's: share of prompts whose rollouts hold both rewards),
  ``anchor_effective_ratio`` (the same over sibling groups), ``mixed_per_100_units``: of the
  rollout trees, averaged over iterations;
- ``tokens``: generated rollout tokens over all iterations;
- ``root_skill``: the predictor's Brier skill on each iteration's new prompts before it
  trained on them (``FitReport.root_skill``: what ranked stage 1's roots), mean over the
  iterations that have one (from the second); ``eval_root_skill``: its Brier skill on the
  held-out evaluation prompts (which no tree holds) against their sampled outcomes, after each
  evaluated iteration's fit, mean over those iterations;
- ``tokens_to_grpo_final``: per seed, the generated tokens after which the strategy's held-out
  accuracy first reaches grpo's final one of the same seed, divided by grpo's total tokens of
  that seed — below 1 means it got there with fewer tokens. Interpolated linearly between the
  two evaluations (every ``eval_every`` iterations) that straddle it; a seed that never gets
  there makes the mean infinite (``n`` counts the seeds that did).

``paired`` holds, for every strategy but grpo, the per-seed difference strategy − grpo of
accuracy, pass1 and the two effective ratios (same seed: the same warm start's sampling, pool
draws and evaluation tasks), with its t interval: the seeds' shared luck cancels. Seeds run
from ``first_seed``, so a result can be checked on seeds it was not tuned on.

Bounded staleness as arms: ``staleness`` (``--staleness 0,1,2``) runs every strategy at each
``max_staleness`` k, arm ``trace@k1`` for k = 1 in ``OUTPUT/trace@k1/seed-S``; the k = 0 arm
keeps the plain name and folder (``trace``), so it is the run a comparison without
``--staleness`` makes. A strategy may name its k itself too: ``trace@64x6@k1``.
``paired_staleness`` then holds, for every arm at k ≥ 1, the per-seed difference arm − the same
strategy (and shape) at k = 0, of the ``paired`` metrics; the pairing against grpo stays for the
arms that do not name a k (``trace``, not ``trace@k1``).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trace_core.algo.plan import strategy as check_strategy
from trace_core.train.config import TrainConfig, warmstart_steps
from trace_core.train.evaluate import ALL
from trace_core.train.loop import train
from trace_core.train.record import IterationRecord
from trace_core.train.warmstart import WarmstartConfig, stored_warmstart, warmstart

DEFAULT_STRATEGIES = ("trace", "grpo", "pcl", "treepo")
METRICS = (
    "accuracy",
    "pass1",
    "prompt_effective_ratio",
    "anchor_effective_ratio",
    "mixed_per_100_units",
    "tokens",
    "tokens_to_grpo_final",
    "root_skill",
    "eval_root_skill",
)
PAIRED = ("accuracy", "pass1", "prompt_effective_ratio", "anchor_effective_ratio")
# Student t's 97.5% quantile for 1..30 degrees of freedom; the normal's 1.96 beyond.
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


@dataclass(frozen=True)
class CompareConfig:
    task: str = "calc"
    output: Path = Path("build/compare")
    init: Path | None = None
    """Starting policy for every run; None warm-starts once into ``OUTPUT/warmstart``."""
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    seeds: int = 3
    first_seed: int = 0
    """Seeds ``first_seed .. first_seed + seeds - 1``."""
    run: TrainConfig = field(default_factory=TrainConfig)
    """Per-run settings (iterations, budget, update, eval); task, output, init, strategy and
    seed are filled in per run."""
    parallel: int = 2
    """Runs at once, each in its own process."""
    staleness: tuple[int, ...] = (0,)
    """Each strategy's ``max_staleness`` values: more than (0,) makes every strategy one arm
    per k (``trace``, ``trace@k1``, ...); 0 must be among several."""

    def __post_init__(self) -> None:
        if not self.strategies:
            raise ValueError("strategies is empty")
        for name in self.strategies:
            if check_strategy(parse_arm(name).strategy).uses_true_value:
                raise ValueError(f"strategy {name!r} needs the true V: simulator only")
        ks = self.staleness
        if not ks or min(ks) < 0 or len(set(ks)) < len(ks):
            raise ValueError(f"--staleness: distinct values >= 0, e.g. 0,1,2; got {_ks(ks)}")
        if len(ks) > 1 and 0 not in ks:
            raise ValueError(f"--staleness {_ks(ks)}: include 0, the arms' paired reference")
        if ks != (0,):
            if self.run.max_staleness:
                raise ValueError("--staleness sets each arm's k: leave out --max-staleness")
            own = [n for n in self.strategies if parse_arm(n).staleness is not None]
            if own:
                raise ValueError(f"--staleness: strategy {own[0]!r} names its own k already")
        if self.seeds < 1 or self.parallel < 1:
            raise ValueError("seeds and parallel must be >= 1")
        if self.first_seed < 0:
            raise ValueError(f"first_seed must be >= 0, got {self.first_seed}")

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    @property
    def arms(self) -> tuple[str, ...]:
        """The compared arms: ``strategies``, each at every k of ``staleness`` (``trace@k1``;
        k = 0 keeps the plain name)."""
        return tuple(
            f"{name}@k{k}" if k else name for name in self.strategies for k in self.staleness
        )

    def folder(self, name: str) -> str:
        """The arm's folder under ``output``: an arm whose shape is the run's own M×N is the
        plain strategy (``trace@128x2`` at M=128, N=2 is ``trace``), and so is one at the run's
        own k (``trace@k0``), so the tables and a plain comparison into one ``--output`` share
        those runs instead of repeating them."""
        arm = parse_arm(name)
        same_m = arm.budget in (None, self.run.budget)
        same_n = arm.continuations in (None, self.run.continuations)
        folder = arm.strategy if same_m and same_n else f"{arm.strategy}@{arm.shape}"
        if arm.staleness not in (None, self.run.max_staleness):
            folder += f"@k{arm.staleness}"
        return folder

    def staleness_of(self, name: str) -> int:
        """The arm's ``max_staleness``: its own ``@kK``, else the run's."""
        own = parse_arm(name).staleness
        return self.run.max_staleness if own is None else own

    def reference(self, name: str) -> str | None:
        """The arm a k ≥ 1 arm is paired against: the same strategy and shape at k = 0."""
        if self.staleness_of(name) == 0:
            return None
        arm = parse_arm(name)
        shape = (arm.strategy, arm.budget or self.run.budget, self._n(arm))
        for other in self.arms:
            them = parse_arm(other)
            same = (them.strategy, them.budget or self.run.budget, self._n(them)) == shape
            if same and self.staleness_of(other) == 0:
                return other
        return None

    def _n(self, arm: Arm) -> int:
        return self.run.continuations if arm.continuations is None else arm.continuations

    def run_config(self, name: str, seed: int, init: Path) -> TrainConfig:
        arm = parse_arm(name)
        return replace(
            self.run,
            task=self.task,
            output=self.output / self.folder(name) / f"seed-{seed}",
            init=init,
            strategy=arm.strategy,
            seed=seed,
            budget=arm.budget or self.run.budget,
            continuations=self._n(arm),
            max_staleness=self.staleness_of(name),
        )


def _ks(values: Sequence[int]) -> str:
    return ",".join(str(k) for k in values) or "nothing"


@dataclass(frozen=True)
class Arm:
    """One compared run setting: a strategy, and optionally its own budget shape M×N and its
    own ``max_staleness`` k."""

    strategy: str
    budget: int | None = None
    continuations: int | None = None
    staleness: int | None = None

    @property
    def shape(self) -> str:
        return f"{self.budget}x{self.continuations}"


def parse_arm(name: str) -> Arm:
    """``trace`` → the run's M, N and k; ``trace@64x6`` → M=64 roots, N=6 continuations;
    ``trace@k1`` → k = 1; ``trace@64x6@k1`` both."""
    strategy, *settings = name.split("@")
    check_strategy(strategy)  # names the strategy it does not know
    arm = Arm(strategy)
    for setting in settings:
        m, x, n = setting.partition("x")
        if setting[:1] == "k" and setting[1:].isdigit() and arm.staleness is None:
            arm = replace(arm, staleness=int(setting[1:]))
        elif x and m.isdigit() and n.isdigit() and int(m) >= 1 and arm.budget is None:
            if arm.staleness is not None:
                break  # the shape comes first
            arm = replace(arm, budget=int(m), continuations=int(n))
        else:
            break
    else:
        return arm
    raise ValueError(
        f"strategy {name!r}: write a budget shape as STRATEGY@MxN, e.g. trace@64x6, a "
        "staleness as STRATEGY@kK, e.g. trace@k1, both as trace@64x6@k1"
    )


@dataclass(frozen=True)
class Curve:
    """One strategy's held-out accuracy against generated tokens, mean over seeds."""

    iterations: list[int]
    tokens: list[float]
    accuracy: list[float]
    accuracy_std: list[float]
    effective_ratio: list[float]
    """Prompt effective ratio per training iteration (mean over seeds), from iteration 1."""


@dataclass(frozen=True)
class CompareResult:
    config: dict[str, object]
    strategies: dict[str, dict[str, dict[str, float]]]
    curves: dict[str, Curve]
    by_difficulty: dict[str, dict[str, float]]
    """Final mean@k per difficulty (mean over seeds)."""
    paired: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """strategy → metric → the interval of (strategy − grpo) over seeds."""
    per_seed: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """strategy → metric → its value per seed (``seed_list`` order), for other pairings."""
    paired_staleness: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """arm at k ≥ 1 → metric → the interval of (arm − the same strategy at k = 0) over seeds;
    empty without staleness arms."""

    def to_json(self) -> dict[str, object]:
        finite = {  # JSON has no Infinity: a strategy that never got there is null
            name: {
                metric: {k: (v if np.isfinite(v) else None) for k, v in stats.items()}
                for metric, stats in row.items()
            }
            for name, row in self.strategies.items()
        }
        data: dict[str, object] = {
            "config": self.config,
            "interval": "95% Student t over seeds",
            "strategies": finite,
            "paired_vs_grpo": self.paired,
        }
        if self.paired_staleness:
            data["paired_vs_k0"] = self.paired_staleness
        return data | {
            "per_seed": self.per_seed,
            "curves": {k: asdict(v) for k, v in self.curves.items()},
            "by_difficulty": self.by_difficulty,
        }

    @property
    def seeds(self) -> tuple[int, int]:
        """(first seed, how many seeds): the comparison ran seeds first .. first + n − 1."""
        return int(str(self.config["first_seed"])), int(str(self.config["seeds"]))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompareResult:
        """The result ``to_json`` wrote, so its tables can be printed again without training
        anything. JSON has no infinity: a null (a strategy that never reached grpo's accuracy,
        a bound over one seed) reads back as NaN."""

        def numbers(row: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float]]:
            return {
                metric: {k: math.nan if v is None else float(v) for k, v in stats.items()}
                for metric, stats in row.items()
            }

        return cls(
            config=data["config"],
            strategies={name: numbers(row) for name, row in data["strategies"].items()},
            curves={name: Curve(**curve) for name, curve in data["curves"].items()},
            by_difficulty=data["by_difficulty"],
            paired={name: numbers(row) for name, row in data["paired_vs_grpo"].items()},
            per_seed=data["per_seed"],
            paired_staleness={
                name: numbers(row) for name, row in data.get("paired_vs_k0", {}).items()
            },
        )


def run_compare(
    config: CompareConfig, progress: Callable[[str], None] | None = None
) -> CompareResult:
    say = progress or (lambda _message: None)
    init = config.init or _warm_start(config, say)
    jobs = [(name, seed) for seed in config.seed_list for name in config.arms]
    threads = max(1, (os.cpu_count() or 1) // config.parallel)
    runs: dict[tuple[str, int], list[IterationRecord]] = {}
    label = {"trace.compare": config.output.resolve().name}  # MLflow: filter on it, compare
    if config.parallel == 1:
        for name, seed in jobs:
            runs[name, seed] = _train_job(config.run_config(name, seed, init), threads, label)
            say(f"{name} seed {seed} done")
    else:
        context = multiprocessing.get_context("spawn")  # no forked torch/ray state
        with ProcessPoolExecutor(config.parallel, mp_context=context) as pool:
            arms = {job: config.run_config(*job, init) for job in jobs}
            futures = {
                pool.submit(_train_job, arm, threads, label): job for job, arm in arms.items()
            }
            for future in as_completed(futures):
                runs[futures[future]] = future.result()
                say(f"{futures[future][0]} seed {futures[future][1]} done")
    return summarize(config, runs)


def _warm_start(config: CompareConfig, say: Callable[[str], None]) -> Path:
    """The comparison's one starting policy, ``OUTPUT/warmstart``: reused when it was made for
    this task with this recipe, made when absent, refused (one line naming the difference)
    when it was made otherwise."""
    path, run = config.output / "warmstart", replace(config.run, task=config.task)
    made = WarmstartConfig(
        task=config.task,
        output=path,
        sft=replace(WarmstartConfig().sft, steps=warmstart_steps(run)),
        eval_tasks=50,
        eval_samples=1,
    )
    if stored_warmstart(path, made, f"this comparison (--task {config.task})") is None:
        say(f"warm start of the {config.task} policy → {path}")
        warmstart(made)
    else:
        say(f"starting from the {config.task} warm start in {path}")
    return path


def _train_job(config: TrainConfig, threads: int, tags: Mapping[str, str]) -> list[IterationRecord]:
    """One arm's run; with MLFLOW_TRACKING_URI set, its own MLflow run named for the arm
    (``trace seed 0``), tagged with the comparison."""
    import torch

    torch.set_num_threads(threads)
    arm = f"{config.output.parent.name} seed {config.seed}"
    return train(config, label=(arm, tags))


def summarize(
    config: CompareConfig, runs: dict[tuple[str, int], list[IterationRecord]]
) -> CompareResult:
    """The table, curves and per-difficulty accuracy from every run's records."""
    curves = {name: _curve(name, config, runs) for name in config.arms}
    per_seed_rows = {name: _seed_rows(name, config, runs) for name in config.arms}
    table: dict[str, dict[str, dict[str, float]]] = {}
    paired: dict[str, dict[str, dict[str, float]]] = {}
    stale: dict[str, dict[str, dict[str, float]]] = {}
    by_difficulty: dict[str, dict[str, float]] = {}
    grpo = per_seed_rows.get("grpo")
    for name in config.arms:
        rows = per_seed_rows[name]
        reference = config.reference(name)
        if reference is not None:
            base = per_seed_rows[reference]
            stale[name] = {m: interval(list(np.subtract(rows[m], base[m]))) for m in PAIRED}
        table[name] = {k: interval(v) for k, v in rows.items()}
        if grpo is not None:
            reach = [
                _tokens_to_reach(_seed_curve(runs[name, s]), _seed_curve(runs["grpo", s])[1][-1])
                / _seed_curve(runs["grpo", s])[0][-1]
                for s in config.seed_list
            ]
            table[name]["tokens_to_grpo_final"] = interval(reach)
            if name != "grpo" and parse_arm(name).staleness is None:
                paired[name] = {m: interval(list(np.subtract(rows[m], grpo[m]))) for m in PAIRED}
        finals = [_last_eval(runs[name, s]) for s in config.seed_list]
        labels = sorted(finals[0]["mean_k"])  # type: ignore[arg-type]
        by_difficulty[name] = {
            label: float(np.mean([f["mean_k"][label] for f in finals]))  # type: ignore[index]
            for label in labels
        }
    return CompareResult(
        _config_json(config), table, curves, by_difficulty, paired, per_seed_rows, stale
    )


def _seed_rows(
    name: str, config: CompareConfig, runs: dict[tuple[str, int], list[IterationRecord]]
) -> dict[str, list[float]]:
    """Each metric's value per seed (in ``seed_list`` order)."""
    per_seed = [runs[name, s] for s in config.seed_list]
    finals = [_last_eval(r) for r in per_seed]

    def over_iterations(key: str) -> list[float]:
        return [float(np.mean([r.rollout[key] for r in rec[1:]])) for rec in per_seed]

    def skill(rec: Sequence[IterationRecord], key: str = "root_skill") -> float:
        scored = [r.predictor[key] for r in rec if key in r.predictor]
        return float(np.mean(scored)) if scored else float("nan")

    return {
        "accuracy": [float(f["mean_k"][ALL]) for f in finals],  # type: ignore[index]
        "pass1": [float(f["pass1"][ALL]) for f in finals],  # type: ignore[index]
        "prompt_effective_ratio": over_iterations("prompt_effective_ratio"),
        "anchor_effective_ratio": over_iterations("anchor_effective_ratio"),
        "mixed_per_100_units": over_iterations("mixed_per_100_units"),
        "tokens": [float(rec[-1].total_tokens) for rec in per_seed],
        "root_skill": [skill(rec) for rec in per_seed],
        "eval_root_skill": [skill(rec, "eval_root_skill") for rec in per_seed],
    }


def _seed_curve(records: Sequence[IterationRecord]) -> tuple[list[float], list[float]]:
    """(generated tokens, held-out mean@k) at each evaluation of one run."""
    evaluated = [r for r in records if r.eval]
    return (
        [float(r.total_tokens) for r in evaluated],
        [float(r.eval["mean_k"][ALL]) for r in evaluated],  # type: ignore[index]
    )


def interval(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample std and the 95% Student-t interval of the finite ``values`` (n: how many
    are finite); a mean over a non-finite value is that value, with no interval."""
    finite = [float(v) for v in values if np.isfinite(v)]
    n = len(finite)
    if n < len(values) or n == 0:
        worst = float(np.mean(values)) if values else float("nan")
        return {"mean": worst, "std": float("nan"), "lo": float("nan"), "hi": float("nan"),
                "n": float(n)}  # fmt: skip
    mean = float(np.mean(finite))
    if n == 1:
        return {"mean": mean, "std": 0.0, "lo": float("nan"), "hi": float("nan"), "n": 1.0}
    std = float(np.std(finite, ddof=1))
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * std / np.sqrt(n)
    return {"mean": mean, "std": std, "lo": mean - half, "hi": mean + half, "n": float(n)}


def bounds(stats: Mapping[str, float | None]) -> tuple[float, float]:
    """(lo, hi) of an ``interval`` entry, NaN for none; reads the ``low``/``high`` keys of
    comparison JSON from earlier versions too."""
    lo, hi = stats.get("lo", stats.get("low")), stats.get("hi", stats.get("high"))
    return (float("nan") if lo is None else float(lo), float("nan") if hi is None else float(hi))


def _curve(
    name: str, config: CompareConfig, runs: dict[tuple[str, int], list[IterationRecord]]
) -> Curve:
    per_seed = [runs[name, s] for s in config.seed_list]
    evaluated = sorted(
        set.intersection(*({r.iteration for r in rec if r.eval} for rec in per_seed))
    )
    acc = np.array(
        [
            [float(rec[i].eval["mean_k"][ALL]) for i in evaluated]  # type: ignore[index]
            for rec in per_seed
        ]
    )  # (seeds, evals)
    tokens = np.array([[rec[i].total_tokens for i in evaluated] for rec in per_seed], float)
    iters = min(len(rec) for rec in per_seed)
    ratio = [
        float(np.mean([rec[i].rollout["prompt_effective_ratio"] for rec in per_seed]))
        for i in range(1, iters)
    ]
    return Curve(
        iterations=evaluated,
        tokens=tokens.mean(axis=0).tolist(),
        accuracy=acc.mean(axis=0).tolist(),
        accuracy_std=acc.std(axis=0).tolist(),
        effective_ratio=ratio,
    )


def _tokens_to_reach(curve: tuple[list[float], list[float]], target: float) -> float:
    """Generated tokens at which the accuracy curve (tokens, accuracy) first reaches
    ``target`` (inf: never), linearly interpolated between the evaluations that straddle it."""
    points = list(zip(*curve, strict=True))
    for i, (tokens, accuracy) in enumerate(points):
        if accuracy >= target - 1e-12:
            if i == 0:
                return tokens
            t0, a0 = points[i - 1]
            return t0 + (target - a0) / (accuracy - a0) * (tokens - t0)
    return float("inf")


def _last_eval(records: Sequence[IterationRecord]) -> dict[str, object]:
    for record in reversed(records):
        if record.eval:
            return record.eval
    raise ValueError("a run without any evaluation")


def _config_json(config: CompareConfig) -> dict[str, object]:
    run = config.run.to_json()
    for per_run in ("task", "output", "init", "strategy", "seed"):
        run.pop(per_run)
    data: dict[str, object] = {"task": config.task, "strategies": list(config.strategies)}
    if config.staleness != (0,):
        data["staleness"] = list(config.staleness)
    return data | {
        "seeds": config.seeds,
        "first_seed": config.first_seed,
        "init": str(config.init) if config.init else None,
        "run": run,
    }


def plot_compare(result: CompareResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, bars) = plt.subplots(
        1, 3, figsize=(16, 4), gridspec_kw={"width_ratios": [4, 4, 3]}
    )
    for name, curve in result.curves.items():
        tokens = np.asarray(curve.tokens) / 1000
        acc, std = np.asarray(curve.accuracy), np.asarray(curve.accuracy_std)
        (line,) = left.plot(tokens, acc, marker="o", label=name)
        left.fill_between(tokens, acc - std, acc + std, color=line.get_color(), alpha=0.15)
        right.plot(range(1, len(curve.effective_ratio) + 1), curve.effective_ratio, label=name)
    left.set(xlabel="generated rollout tokens (thousands)", ylabel="held-out mean@k")
    left.set_title("accuracy vs tokens (mean ± std over seeds)")
    right.set(xlabel="iteration", ylabel="prompt effective ratio", ylim=(0, 1.02))
    right.set_title("share of prompts with mixed rewards")
    names = list(result.strategies)
    ratio = [result.strategies[n]["prompt_effective_ratio"] for n in names]
    means = np.array([r["mean"] for r in ratio])
    errors = np.nan_to_num(
        [[r["mean"] - bounds(r)[0] for r in ratio], [bounds(r)[1] - r["mean"] for r in ratio]]
    )
    bars.barh(range(len(names)), means, xerr=errors, color="#7a9cc6", capsize=3)
    bars.set_yticks(range(len(names)), names)
    bars.invert_yaxis()
    bars.set(xlabel="prompt effective ratio, mean over iterations", xlim=(0, 1))
    bars.set_title("effective ratio (95% interval over seeds)")
    bars.grid(alpha=0.3, axis="x")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
