"""One simulated iteration of a strategy: score the pool, plan roots, roll out, expand prefixes.

This is the rollout step of the pipeline with the simulator standing in for engine and task,
so the allocation can be judged where the truth is known: ``trace-rl bench allocation``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_core.algo.plan import Budget, plan, strategy
from trace_core.algo.tree import RolloutTree, TreeInfo, leaf_counts, recursive_targets
from trace_core.envs.sim.predictor import FeaturePredictor
from trace_core.envs.sim.world import Pool, SimConfig, SimTree


@dataclass(frozen=True)
class SimBatch:
    """One iteration's trees with the simulator's hidden per-node state."""

    trees: list[RolloutTree]
    features: list[np.ndarray]  # per tree, (n,) noisy feature of every node
    depths: list[np.ndarray]  # per tree, (n,) turn depth of every node


def run_iteration(
    name: str,
    pool: Pool,
    budget: Budget,
    sim: SimConfig,
    predictor: FeaturePredictor | None,
    rng: np.random.Generator,
    iteration: int = 0,
    run_id: str = "sim",
) -> SimBatch:
    """Roll out one iteration of strategy ``name`` on ``pool``.

    Stage 2 for a prompt starts as soon as that prompt's roots are sampled and reads only
    them, as the real rollout step does. Every scored node keeps the V it was scored with.
    """
    spec = strategy(name)
    if spec.uses_predictor and predictor is None:
        raise ValueError(f"strategy {name!r} needs a predictor")

    def score(feature: np.ndarray, depth: np.ndarray, truth: np.ndarray) -> np.ndarray:
        if spec.uses_true_value:
            return truth
        if predictor is None:
            return np.full(len(truth), 0.5)
        return predictor.predict(feature, depth)

    root_v = score(pool.feature, np.zeros(len(pool.value)), pool.value)
    root_plan = plan(name, root_v, budget, rng)
    trees, features, depths = [], [], []
    for i in np.flatnonzero(root_plan.counts):
        info = TreeInfo(run_id, iteration, f"prompt-{iteration}-{i}", int(i), name, iteration)
        state = SimTree.start(sim, info, float(pool.value[i]), float(pool.feature[i]), rng)
        state.builder.set_predicted_v(0, float(root_v[i]))
        for _ in range(int(root_plan.counts[i])):
            state.rollout(0, rng)
        if not spec.flat and state.prefixes:
            nodes = np.asarray(state.prefixes)
            feature = np.asarray(state.feature)[nodes]
            depth = np.asarray(state.depth)[nodes]
            values = score(feature, depth, np.asarray(state.true_v)[nodes])
            for node, v in zip(nodes, values, strict=True):
                state.builder.set_predicted_v(int(node), float(v))
            counts = root_plan.expand(int(i), state.prefix_reward, values, rng)
            for node, k in zip(nodes, counts, strict=True):
                for _ in range(int(k)):
                    state.rollout(int(node), rng, branch=True)
        trees.append(state.build())
        features.append(np.asarray(state.feature))
        depths.append(np.asarray(state.depth))
    return SimBatch(trees, features, depths)


def observe_batch(predictor: FeaturePredictor, batch: SimBatch) -> None:
    """Give the predictor every inner node of the batch with its recursive target V̂."""
    for tree, feature, depth in zip(batch.trees, batch.features, batch.depths, strict=True):
        inner = ~tree.leaf_mask
        predictor.observe(
            feature[inner], depth[inner], recursive_targets(tree)[inner], leaf_counts(tree)[inner]
        )
