"""``trace-rl bench contrast``: every strategy at equal budget with a real policy, engine, task.

The allocation benchmark's question asked of the real thing: with the warm-started tiny policy
sampling through ``TorchEngine`` and the task's own env and reward, how much reward contrast
does each strategy buy per rollout unit? The policy is frozen, so the strategies differ only
in where they spend the budget.

Every iteration draws a fresh pool from the train split (the same pool for every strategy, so
they are compared on common prompts); each strategy that uses a predictor keeps its own
``HashedFeaturePredictor``, refitted on its own trees after each iteration. As in ``bench
allocation``, the first iteration is a cold start and figures are means over iterations 2..I.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from trace_core.algo.metrics import measure
from trace_core.algo.plan import STRATEGIES, Budget, strategy
from trace_core.algo.prefix import Predictor
from trace_core.bench.allocation import METRICS, Summary
from trace_core.envs.suites import make_suite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import load_checkpoint
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor, HashedFeaturePredictor

REAL_STRATEGIES = tuple(s for s in STRATEGIES if not strategy(s).uses_true_value)
TIMING = ("wall_seconds", "tokens_per_s")


@dataclass(frozen=True)
class ContrastBenchConfig:
    checkpoint: Path
    """Warm-started policy directory."""
    task: str = "calc"
    prompts: int = 512
    """Candidate prompts per iteration's pool."""
    budget: int = 128
    """M root rollouts; every strategy spends M(1 + N/2) units."""
    continuations: int = 2
    group: int = 8
    iterations: int = 4
    seed: int = 0
    max_tokens: int = 48
    strategies: tuple[str, ...] = REAL_STRATEGIES
    data: str | None = None

    def __post_init__(self) -> None:
        if not self.strategies:
            raise ValueError("strategies is empty; name at least one of " + ", ".join(STRATEGIES))
        for name in self.strategies:
            if strategy(name).uses_true_value:
                raise ValueError(f"strategy {name!r} needs the true V: simulator only")
        if self.iterations < 1 or self.prompts < 1:
            raise ValueError("iterations and prompts must be >= 1")
        Budget(self.budget, self.continuations, self.group)


@dataclass(frozen=True)
class ContrastBenchResult:
    config: ContrastBenchConfig
    strategies: dict[str, dict[str, Summary]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.config).items()}
        return {
            "config": config,
            "strategies": {
                name: {metric: asdict(s) for metric, s in metrics.items()}
                for name, metrics in self.strategies.items()
            },
        }


def run_contrast_bench(
    config: ContrastBenchConfig, progress: Callable[[str], None] | None = None
) -> ContrastBenchResult:
    suite = make_suite(config.task, config.data, config.seed)
    model, tokenizer = load_checkpoint(config.checkpoint)
    fmt = TurnFormat(tokenizer)
    budget = Budget(config.budget, config.continuations, config.group)
    train = suite.tasks("train")
    predictors: dict[str, HashedFeaturePredictor] = {
        name: HashedFeaturePredictor(turn_token=fmt.end_of_turn_id)
        for name in config.strategies
        if strategy(name).uses_predictor
    }
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in config.strategies}
    for it in range(config.iterations):
        pick = np.random.default_rng([config.seed, it]).permutation(len(train))[: config.prompts]
        pool = [train[i] for i in pick]
        for k, name in enumerate(config.strategies):
            engine = TorchEngine(model)  # a fresh prefix cache: no strategy rides another's
            predictor: Predictor = predictors.get(name) or ConstantPredictor()
            grow = GrowConfig(
                name,
                budget,
                SamplingParams(max_tokens=config.max_tokens),
                seed=int(np.random.default_rng([config.seed, it, k]).integers(2**31)),
                iteration=it,
            )
            start = time.perf_counter()
            trees = grow_trees(engine, fmt, suite.make_env, pool, predictor, grow)
            seconds = time.perf_counter() - start
            metrics = measure(trees).as_dict()
            metrics["wall_seconds"] = seconds
            metrics["tokens_per_s"] = metrics["tokens"] / seconds
            rows[name].append(metrics)
            if name in predictors:
                predictors[name].observe(trees)
                predictors[name].fit()
            if progress:
                progress(name)
    counted = slice(1, None) if config.iterations > 1 else slice(None)
    summary = {
        name: {
            m: Summary(
                float(np.mean([r[m] for r in per[counted]])),
                float(np.std([r[m] for r in per[counted]])),
            )
            for m in (*METRICS, *TIMING)
        }
        for name, per in rows.items()
    }
    return ContrastBenchResult(config, summary)
