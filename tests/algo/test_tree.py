"""Rollout trees: validation, budget accounting, and the recursions against plain loops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.algo.tree import (
    RolloutTree,
    TreeBuilder,
    TreeInfo,
    leaf_counts,
    recursive_targets,
    rollout_prefixes,
    sibling_groups,
    subtree_sums,
)


def drawn_tree() -> RolloutTree:
    """Two root rollouts; the first branches at its first turn.

    0 (prompt)
    ├── 1 ── 2 (r=1)
    │   └── 3 (r=0, branch)
    └── 4 ── 5 ── 6 (r=0)
    """
    b = TreeBuilder(TreeInfo(prompt_id="p"), prompt_tokens=[1, 2, 3], prompt_text="q")
    n1 = b.add_turn(0, [5, 6], [7], text="t1")
    b.set_reward(b.add_turn(n1, [8], [9]), 1)
    b.set_reward(b.add_turn(n1, [10, 11, 12], [], branch=True), 0)
    n4 = b.add_turn(0, [13], [14])
    b.set_reward(b.add_turn(b.add_turn(n4, [15], [16]), [17], []), 0)
    return b.build()


def test_drawn_tree_accounting() -> None:
    tree = drawn_tree()
    assert tree.root_rollouts == 2 and tree.continuations == 1
    assert tree.units == 2.5  # 2 roots · 1 + 1 continuation · 0.5
    assert tree.generated_tokens == 2 + 1 + 3 + 1 + 1 + 1
    assert tree.depth.tolist() == [0, 1, 2, 2, 1, 2, 3]
    assert leaf_counts(tree).tolist() == [3, 2, 1, 1, 1, 1, 1]
    # V̂(1) = (1 + 0)/2; V̂(4) = V̂(5) = 0; V̂(0) = (2·0.5 + 1·0)/3 = 1/3
    np.testing.assert_allclose(recursive_targets(tree), [1 / 3, 0.5, 1, 0, 0, 0, 0])
    # Non-terminal nodes of root rollouts: 1, 4, 5 (not the root, not leaves, not branch 3)
    assert rollout_prefixes(tree).tolist() == [1, 4, 5]
    groups = sibling_groups(tree)
    assert [g.anchor for g in groups] == [0, 1]
    # At the root: leaves {2: 1, 3: 0} under child 1, {6: 0} under child 4. Pairs that split
    # at the root: (2, 6) only → 1. At node 1: (2, 3) → 1.
    assert [(g.mixed, g.contrast_pairs) for g in groups] == [(True, 1), (True, 1)]
    assert tree.path(3).tolist() == [0, 1, 3]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"parent": np.array([-1, 1])}, r"node 1: parent 1 must be in \[0, 1\)"),
        ({"parent": np.array([0, 0])}, "node 0 must be the root"),
        ({"reward": np.array([np.nan, np.nan])}, "node 1 is a leaf without a reward"),
        ({"reward": np.array([np.nan, 0.5])}, "node 1: reward 0.5 is not 0 or 1"),
        ({"reward": np.array([1.0, 1.0])}, "node 0 has children and a reward"),
        ({"branch": np.array([False, True])}, "continuation from a turn, not from the root"),
        ({"gen_tokens": (np.zeros(0, np.int32), np.zeros(1, np.int64))}, "int32"),
        ({"logprobs": (np.zeros(0, np.float32), np.zeros(2, np.float32))}, "2 logprobs for 1"),
        ({"text": ("q",)}, "text has 1 entries for 2 nodes"),
    ],
)
def test_invalid_trees_are_refused(edit: dict[str, object], message: str) -> None:
    b = TreeBuilder(TreeInfo())
    b.set_reward(b.add_turn(0, [4], [5]), 1)
    fields = dict(b.build().__dict__)
    fields.pop("leaf_mask", None)
    fields.pop("depth", None)
    fields.update(edit)
    with pytest.raises(ValueError, match=message):
        RolloutTree(**fields)  # type: ignore[arg-type]


def test_builder_refuses_unknown_parent() -> None:
    with pytest.raises(ValueError, match="parent 3 is not a node"):
        TreeBuilder(TreeInfo()).add_turn(3)


@st.composite
def random_trees(draw: st.DrawFn) -> RolloutTree:
    size = draw(st.integers(1, 30))
    b = TreeBuilder(TreeInfo())
    parents = [-1]
    for i in range(1, size):
        parents.append(draw(st.integers(0, i - 1)))
        b.add_turn(parents[i], [i], branch=parents[i] != 0 and draw(st.booleans()))
    for node in set(range(1, size)) - set(parents):
        b.set_reward(node, draw(st.sampled_from([0.0, 1.0])))
    return b.build()


@settings(max_examples=150, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16))
def test_recursions_match_loops(tree: RolloutTree, seed: int) -> None:
    values = np.random.default_rng(seed).random(tree.size)
    # subtree sums: walk every node up to the root, adding its value to each ancestor
    expected = values.copy()
    for node in range(1, tree.size):
        up = tree.parent[node]
        while up != -1:
            expected[up] += values[node]
            up = tree.parent[up]
    np.testing.assert_allclose(subtree_sums(tree, values), expected)
    # recursive targets satisfy V̂(y) = (1/n_y) Σ_c n_c V̂(c) at every inner node
    n, v = leaf_counts(tree), recursive_targets(tree)
    for node, kids in enumerate(tree.children()):
        if len(kids):
            assert n[node] == n[kids].sum()
            assert v[node] == pytest.approx((n[kids] * v[kids]).sum() / n[node])
        elif node:
            assert v[node] == tree.reward[node]
