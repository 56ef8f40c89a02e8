"""Advantage estimators on rollout trees: worked examples, then loops vs the vectorised code."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.algo.advantage import (
    ESTIMATORS,
    GRPO_EPS,
    path_token_advantages,
    token_advantages,
    token_loss_mask,
    turn_advantages,
)
from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo


# --- trees -------------------------------------------------------------------------------
def flat_tree(rewards: list[float]) -> RolloutTree:
    """Root rollouts only, one turn each: the plain GRPO group."""
    b = TreeBuilder(TreeInfo(), prompt_tokens=np.array([7, 7]))
    for r in rewards:
        b.set_reward(b.add_turn(0, gen_tokens=[1, 2], obs_tokens=[3]), r)
    return b.build()


def small_tree() -> RolloutTree:
    """Two root rollouts; rollout A's first turn (node 1) is branched once.

            0 root
           /      \\
          1        3  r=0      leaves: 2 (r=1), 3 (r=0), 4 (r=0)
         / \\                   root group {2, 3, 4}: mean 1/3
        2   4*                 node-1 group {2, 4}:  mean 1/2
       r=1  r=0                (* = branch)
    """
    b = TreeBuilder(TreeInfo(), prompt_tokens=np.array([9]))
    n1 = b.add_turn(0, gen_tokens=[1], obs_tokens=[2])
    n2 = b.add_turn(n1, gen_tokens=[3])
    n3 = b.add_turn(0, gen_tokens=[4])
    n4 = b.add_turn(n1, gen_tokens=[5], branch=True)
    b.set_reward(n2, 1.0)
    b.set_reward(n3, 0.0)
    b.set_reward(n4, 0.0)
    return b.build()


def drawn_tree() -> RolloutTree:
    """Three levels. Root rollouts 1→4→6 and 2; branches 3, 5 (from 1) and 7 (from 4).

                  0   V̂ = 3/5
                /   \\
        V̂=3/4  1     2  r=0
             / | \\
          r=1 3* 4  5* r=0
                 | \\
             r=1 6   7* r=1     (4: V̂ = 1)
    """
    b = TreeBuilder(TreeInfo())
    for parent, branch in [(0, False), (0, False), (1, True), (1, False), (1, True), (4, False)]:
        b.add_turn(parent, gen_tokens=[1], branch=branch)
    b.add_turn(4, gen_tokens=[1], branch=True)
    for node, r in {2: 0.0, 3: 1.0, 5: 0.0, 6: 1.0, 7: 1.0}.items():
        b.set_reward(node, r)
    return b.build()


@st.composite
def random_trees(draw: st.DrawFn, max_turns: int = 24) -> RolloutTree:
    """Random parents; 0/1 rewards at leaves; some non-root children are branches."""
    turns = draw(st.integers(0, max_turns))
    prompt = draw(st.lists(st.integers(0, 99), max_size=3))
    b = TreeBuilder(TreeInfo(), prompt_tokens=np.array(prompt, dtype=np.int32))
    parents = [-1]
    for i in range(1, turns + 1):
        parent = draw(st.integers(0, i - 1))
        parents.append(parent)
        gen = draw(st.lists(st.integers(0, 99), max_size=3))
        obs = draw(st.lists(st.integers(0, 99), max_size=3))
        branch = parent != 0 and draw(st.booleans())
        b.add_turn(parent, gen_tokens=gen, obs_tokens=obs, branch=branch)
    for node in range(1, b.size):
        if node not in parents:
            b.set_reward(node, draw(st.sampled_from([0.0, 1.0])))
    return b.build()


# --- plain-loop references ---------------------------------------------------------------
def ref_leaves(tree: RolloutTree) -> list[int]:
    parents = [int(p) for p in tree.parent]
    return [i for i in range(1, len(parents)) if i not in parents]


def ref_ancestors(tree: RolloutTree, node: int) -> list[int]:
    """Proper ancestors of ``node``, nearest first, ending at the root."""
    out = []
    while node != 0:
        node = int(tree.parent[node])
        out.append(node)
    return out


def ref_leaves_below(tree: RolloutTree, node: int) -> list[int]:
    return [leaf for leaf in ref_leaves(tree) if leaf == node or node in ref_ancestors(tree, leaf)]


def ref_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def ref_leaf_advantage(tree: RolloutTree, estimator: str) -> dict[int, float]:
    leaves = ref_leaves(tree)
    r = {leaf: float(tree.reward[leaf]) for leaf in leaves}
    if not leaves:
        return {}
    mean = ref_mean(list(r.values()))
    std = math.sqrt(ref_mean([(x - mean) ** 2 for x in r.values()]))
    out = {}
    for leaf in leaves:
        if estimator == "grpo":
            out[leaf] = 0.0 if std == 0 else (r[leaf] - mean) / (std + 1e-6)
        elif estimator == "drgrpo":
            out[leaf] = r[leaf] - mean
        elif estimator == "treepo":
            centred = []
            for a in ref_ancestors(tree, leaf):
                group = ref_leaves_below(tree, a)
                if len(group) > 1:
                    centred.append(r[leaf] - ref_mean([r[g] for g in group]))
            out[leaf] = ref_mean(centred) if centred else 0.0
    return out


def ref_turn_advantages(tree: RolloutTree, estimator: str) -> list[float]:
    out = [0.0]
    if estimator == "treerl":

        def v(y: int) -> float:
            return ref_mean([float(tree.reward[leaf]) for leaf in ref_leaves_below(tree, y)])

        for y in range(1, tree.size):
            out.append((v(y) - v(int(tree.parent[y]))) + (v(y) - v(0)))
        return out
    leaf_adv = ref_leaf_advantage(tree, estimator)
    for y in range(1, tree.size):
        out.append(ref_mean([leaf_adv[leaf] for leaf in ref_leaves_below(tree, y)]))
    return out


# --- worked examples ---------------------------------------------------------------------
def test_grpo_flat_group() -> None:
    # rewards [1, 0, 0, 1] → mean 0.5, population std 0.5 → z = ±0.5 / (0.5 + 1e-6) ≈ ±1
    adv = turn_advantages(flat_tree([1, 0, 0, 1]), "grpo")
    z = 0.5 / (0.5 + GRPO_EPS)
    np.testing.assert_allclose(adv, [0.0, z, -z, -z, z])
    np.testing.assert_allclose(adv, [0, 1, -1, -1, 1], atol=1e-5)


def test_drgrpo_flat_group() -> None:
    # rewards [1, 0, 0, 0] → mean 0.25 → r - mean = [0.75, -0.25, -0.25, -0.25], no std
    adv = turn_advantages(flat_tree([1, 0, 0, 0]), "drgrpo")
    np.testing.assert_allclose(adv, [0.0, 0.75, -0.25, -0.25, -0.25])


def test_small_tree_leaf_estimators() -> None:
    tree = small_tree()
    # grpo: rewards {2: 1, 3: 0, 4: 0}, mean 1/3,
    # var = ((2/3)² + (1/3)² + (1/3)²) / 3 = (6/9) / 3 = 2/9 → std = √2/3 ≈ 0.4714
    # z(2) = (2/3) / (√2/3) = √2, z(3) = z(4) = -(1/3) / (√2/3) = -1/√2
    # node 1 = mean(z(2), z(4)) = (√2 - 1/√2) / 2 = 1/(2√2) ≈ 0.3536
    std = math.sqrt(2) / 3 + GRPO_EPS
    z_win, z_lose = (2 / 3) / std, -(1 / 3) / std
    np.testing.assert_allclose(
        turn_advantages(tree, "grpo"), [0, (z_win + z_lose) / 2, z_win, z_lose, z_lose]
    )
    r2 = math.sqrt(2)
    np.testing.assert_allclose(
        turn_advantages(tree, "grpo"), [0, 1 / (2 * r2), r2, -1 / r2, -1 / r2], atol=1e-5
    )
    # drgrpo: r - 1/3 → 2: 2/3, 3: -1/3, 4: -1/3; node 1 = (2/3 - 1/3) / 2 = 1/6
    np.testing.assert_allclose(turn_advantages(tree, "drgrpo"), [0, 1 / 6, 2 / 3, -1 / 3, -1 / 3])
    # treepo: leaf 2 sees the root group (1 - 1/3 = 2/3) and node 1's group (1 - 1/2 = 1/2)
    #   → (2/3 + 1/2) / 2 = 7/12
    # leaf 4: (0 - 1/3) and (0 - 1/2) → (-1/3 - 1/2) / 2 = -5/12
    # leaf 3: only the root group → -1/3
    # node 1 = mean(7/12, -5/12) = 1/12
    np.testing.assert_allclose(
        turn_advantages(tree, "treepo"), [0, 1 / 12, 7 / 12, -1 / 3, -5 / 12]
    )


def test_treerl_hand_drawn_tree() -> None:
    # V̂: leaves as rewarded; 4 = mean(1, 1) = 1; 1 = mean(3, 6, 7, 5) = 3/4;
    # root = mean(2, 3, 5, 6, 7) = 3/5. A(y) = (V̂(y) - V̂(parent)) + (V̂(y) - 3/5):
    # 1: (3/4 - 3/5) + (3/4 - 3/5) = 0.15 + 0.15 = 0.3
    # 2: (0 - 3/5) + (0 - 3/5) = -1.2
    # 3: (1 - 3/4) + (1 - 3/5) = 0.25 + 0.4 = 0.65
    # 4: (1 - 3/4) + (1 - 3/5) = 0.65
    # 5: (0 - 3/4) + (0 - 3/5) = -1.35
    # 6, 7: (1 - 1) + (1 - 3/5) = 0.4
    adv = turn_advantages(drawn_tree(), "treerl")
    np.testing.assert_allclose(adv, [0, 0.3, -1.2, 0.65, 0.65, -1.35, 0.4, 0.4], atol=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_singleton_group_is_zero(estimator: str) -> None:
    # one rollout of two turns: every group holds one leaf, so there is nothing to contrast
    b = TreeBuilder(TreeInfo())
    b.set_reward(b.add_turn(b.add_turn(0, gen_tokens=[1]), gen_tokens=[2]), 1.0)
    np.testing.assert_array_equal(turn_advantages(b.build(), estimator), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_uniform_rewards_are_zero(estimator: str) -> None:
    # all rollouts succeed: mean 1, std 0 → no signal (and no division by eps)
    np.testing.assert_array_equal(turn_advantages(flat_tree([1, 1, 1]), estimator), np.zeros(4))
    # same with branches: every group in small_tree's shape fails
    b = TreeBuilder(TreeInfo())
    n1 = b.add_turn(0)
    for leaf in (b.add_turn(n1), b.add_turn(0), b.add_turn(n1, branch=True)):
        b.set_reward(leaf, 0.0)
    np.testing.assert_array_equal(turn_advantages(b.build(), estimator), np.zeros(5))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_lone_root(estimator: str) -> None:
    # a skipped prompt: nothing sampled, one zero for the root
    np.testing.assert_array_equal(
        turn_advantages(TreeBuilder(TreeInfo()).build(), estimator), [0.0]
    )


def test_unknown_estimator_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="grpo, drgrpo, treepo, treerl"):
        turn_advantages(small_tree(), "ppo")


# --- tokens ------------------------------------------------------------------------------
def test_token_layout_on_small_tree() -> None:
    tree = small_tree()
    adv = turn_advantages(tree, "drgrpo")  # [0, 1/6, 2/3, -1/3, -1/3]
    per_node = token_advantages(tree, adv)
    mask = token_loss_mask(tree)
    # root: prompt [9] only → one 0, masked out
    np.testing.assert_array_equal(per_node[0], [0.0])
    np.testing.assert_array_equal(mask[0], [False])
    # node 1: gen [1] then obs [2] → [1/6, 0], mask [T, F]
    np.testing.assert_allclose(per_node[1], [1 / 6, 0.0])
    np.testing.assert_array_equal(mask[1], [True, False])
    # path 0 → 1 → 4: prompt [9], gen [1], obs [2], gen [5]
    path = path_token_advantages(tree, 4, adv)
    np.testing.assert_array_equal(path.tokens, [9, 1, 2, 5])
    np.testing.assert_allclose(path.advantages, [0, 1 / 6, 0, -1 / 3])
    np.testing.assert_array_equal(path.loss_mask, [False, True, False, True])
    np.testing.assert_array_equal(path.logprobs, np.zeros(4, np.float32))


def test_path_keeps_sampling_logprobs() -> None:
    b = TreeBuilder(TreeInfo(), prompt_tokens=np.array([5, 6]))
    leaf = b.add_turn(0, gen_tokens=[1, 2], obs_tokens=[3], logprobs=[-0.5, -1.5])
    b.set_reward(leaf, 1.0)
    tree = b.build()
    path = path_token_advantages(tree, leaf, np.array([0.0, 2.0]))
    np.testing.assert_array_equal(path.tokens, [5, 6, 1, 2, 3])
    np.testing.assert_array_equal(path.logprobs, np.array([0, 0, -0.5, -1.5, 0], np.float32))
    np.testing.assert_array_equal(path.advantages, [0, 0, 2, 2, 0])


def test_path_rejects_inner_node_and_wrong_shape() -> None:
    tree = small_tree()
    adv = turn_advantages(tree, "grpo")
    with pytest.raises(ValueError, match="not a leaf"):
        path_token_advantages(tree, 1, adv)
    with pytest.raises(ValueError, match="one per node"):
        token_advantages(tree, adv[:-1])


# --- properties against the loops ----------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(tree=random_trees())
def test_estimators_match_plain_loops(tree: RolloutTree) -> None:
    for estimator in ESTIMATORS:
        adv = turn_advantages(tree, estimator)
        assert adv.shape == (tree.size,) and adv.dtype == np.float64
        np.testing.assert_allclose(
            adv, ref_turn_advantages(tree, estimator), rtol=1e-9, atol=1e-9, err_msg=estimator
        )


@settings(max_examples=40, deadline=None)
@given(tree=random_trees(), estimator=st.sampled_from(ESTIMATORS))
def test_tokens_follow_the_sampled_sequence(tree: RolloutTree, estimator: str) -> None:
    adv = turn_advantages(tree, estimator)
    per_node, mask = token_advantages(tree, adv), token_loss_mask(tree)
    for i in range(tree.size):
        n_gen, n_obs = len(tree.gen_tokens[i]), len(tree.obs_tokens[i])
        assert len(per_node[i]) == len(mask[i]) == n_gen + n_obs
        assert np.all(per_node[i][n_gen:] == 0.0)  # observations (and the prompt) get exactly 0
        assert np.all(per_node[i][:n_gen] == adv[i])
        assert mask[i].sum() == n_gen and mask[i][:n_gen].all()
    for leaf in ref_leaves(tree):
        path = path_token_advantages(tree, leaf, adv)
        nodes = [leaf, *ref_ancestors(tree, leaf)][::-1]
        expected = [t for i in nodes for t in [*tree.gen_tokens[i], *tree.obs_tokens[i]]]
        np.testing.assert_array_equal(path.tokens, expected)
        np.testing.assert_array_equal(path.advantages, np.concatenate([per_node[i] for i in nodes]))
        np.testing.assert_array_equal(path.loss_mask, np.concatenate([mask[i] for i in nodes]))
        assert np.all(path.advantages[~path.loss_mask] == 0.0)
