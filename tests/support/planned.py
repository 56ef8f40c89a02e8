"""Shared by the engine-pool tests (``tests/rollout``, ``tests/vllm``): the trees a rollout gave
are exactly the ones it planned."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trace_core.algo.plan import Budget, plan
from trace_core.algo.tree import RolloutTree


def check_trees_are_the_planned_ones(
    trees: Sequence[RolloutTree], tasks: int, budget: Budget, seed: int
) -> None:
    """Every tree ``grow_trees`` plans over ``tasks`` prompts with a constant predictor (0.5)
    and ``default_rng(seed)``, exactly once and complete, with exactly the budget's units."""
    roots = plan("trace", np.full(tasks, 0.5), budget, np.random.default_rng(seed))
    assert [t.info.tree_id for t in trees] == np.flatnonzero(roots.counts).tolist()
    for tree in trees:
        i = tree.info.tree_id
        assert tree.root_rollouts == roots.counts[i]
        assert tree.continuations == roots.continuations[i]
        assert not np.isnan(tree.reward[tree.leaf_mask]).any()  # every leaf has its reward
        assert np.isnan(tree.reward[~tree.leaf_mask]).all()
    assert sum(t.units for t in trees) == budget.units
