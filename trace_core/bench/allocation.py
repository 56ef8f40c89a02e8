"""``trace-rl bench allocation``: every strategy at an equal budget on the simulator.

For each seed, each iteration draws a fresh pool of prompts (the same pool for every strategy,
so they are compared on common random numbers); every strategy that needs a predictor keeps its
own, refitted on its own trees after each iteration. The first iteration is a cold start (the
predictors have seen nothing and answer 0.5), so with two or more iterations a seed's figure is
the mean over iterations 2..I; the table gives mean ± std of those figures over seeds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from trace_core.algo.metrics import measure
from trace_core.algo.plan import STRATEGIES, Budget, strategy
from trace_core.envs.sim.predictor import FeaturePredictor
from trace_core.envs.sim.rollout import observe_batch, run_iteration
from trace_core.envs.sim.world import SimConfig, draw_pool

METRICS = (
    "prompt_effective_ratio",
    "anchor_effective_ratio",
    "mixed_per_100_units",
    "contrast_pairs",
    "units",
    "tokens",
)


@dataclass(frozen=True)
class AllocationBenchConfig:
    prompts: int = 2048
    """B: candidate prompts in each iteration's pool."""
    budget: int = 1024
    """M: root rollouts of a tree strategy; every strategy spends M(1 + N/2) units."""
    continuations: int = 2
    """N: continuations per root rollout."""
    group: int = 8
    """Group size of the fixed-group strategies."""
    sim: SimConfig = field(default_factory=SimConfig)
    seeds: int = 3
    iterations: int = 4
    strategies: tuple[str, ...] = tuple(STRATEGIES)

    def __post_init__(self) -> None:
        if not self.strategies:
            raise ValueError("strategies is empty; name at least one of " + ", ".join(STRATEGIES))
        for name in self.strategies:
            strategy(name)
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if self.seeds < 1 or self.iterations < 1:
            raise ValueError("seeds and iterations must be >= 1")
        Budget(self.budget, self.continuations, self.group)  # validates


@dataclass(frozen=True)
class Summary:
    mean: float
    std: float


@dataclass(frozen=True)
class AllocationBenchResult:
    config: AllocationBenchConfig
    strategies: dict[str, dict[str, Summary]]

    def to_json(self) -> dict[str, object]:
        return {
            "config": asdict(self.config),
            "strategies": {
                name: {metric: asdict(s) for metric, s in metrics.items()}
                for name, metrics in self.strategies.items()
            },
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def run_allocation_bench(
    config: AllocationBenchConfig,
    progress: Callable[[str], None] | None = None,
) -> AllocationBenchResult:
    budget = Budget(config.budget, config.continuations, config.group)
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in config.strategies}
    for seed in range(config.seeds):
        predictors = {
            name: FeaturePredictor() for name in config.strategies if strategy(name).uses_predictor
        }
        history: dict[str, list[dict[str, float]]] = {name: [] for name in config.strategies}
        for it in range(config.iterations):
            pool_rng = np.random.default_rng([seed, it])
            pool = draw_pool(config.sim, config.prompts, pool_rng)
            for k, name in enumerate(config.strategies):
                rng = np.random.default_rng([seed, it, k, 1])
                predictor = predictors.get(name)
                batch = run_iteration(name, pool, budget, config.sim, predictor, rng, it)
                history[name].append(measure(batch.trees).as_dict())
                if predictor is not None:
                    observe_batch(predictor, batch)
                    predictor.fit()
                if progress:
                    progress(name)
        counted = slice(1, None) if config.iterations > 1 else slice(None)
        for name in config.strategies:
            rows = history[name][counted]
            per_seed[name].append({m: float(np.mean([r[m] for r in rows])) for m in METRICS})
    summary = {
        name: {
            m: Summary(float(np.mean([s[m] for s in seeds])), float(np.std([s[m] for s in seeds])))
            for m in METRICS
        }
        for name, seeds in per_seed.items()
    }
    return AllocationBenchResult(config, summary)
