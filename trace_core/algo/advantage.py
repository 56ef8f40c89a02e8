"""Advantages on a rollout tree: one number per turn, then one per sampled token.

``turn_advantages(tree, estimator)`` returns an (n,) array with one advantage per node
(the root, which holds the prompt, always gets 0). ``token_advantages`` broadcasts it over
each node's tokens, and ``path_token_advantages`` lays one root-to-leaf trajectory out
exactly as it was sampled (prompt, then generated and observation tokens of every turn),
which is what a trainer consumes. Observation and prompt tokens always get advantage 0
and are masked out of the loss: the model read them, it did not generate them.

Estimators (``ESTIMATORS``; one ``match`` in ``turn_advantages`` picks among them):

- ``grpo``: the z-score of each leaf's reward over all leaves of the tree (the root group),
  ``(r - mean) / (std + 1e-6)`` with the population std.
- ``drgrpo``: ``r - mean`` over the same group (Dr. GRPO: no std division).
- ``treepo``: each leaf averages ``r - mean(G)`` over the subgroups G on its path, where G
  is the set of leaves below one of its proper ancestors (the root included); subgroups of
  a single leaf carry no contrast and are skipped.
- ``treerl``: node-level, ``A(y) = (V̂(y) - V̂(parent(y))) + (V̂(y) - V̂(root))`` with V̂
  the recursive targets (mean leaf reward below y): a local gain over the parent plus a
  global gain over the prompt.

The first three produce one advantage per leaf, i.e. per root-to-leaf trajectory. A turn
shared by several trajectories gets the MEAN of the advantages of the leaves below it. For
a flat tree (root rollouts only) every turn simply carries its trajectory's advantage.
Training on paths (each root-to-leaf sequence once, shared turns repeated) weights every
node by its leaf count n_y, so a shared turn contributes n_y × mean = the sum of its
trajectories' advantages: for a loss linear in the advantage, the same gradient as giving
every path its own leaf's advantage on all of its tokens. We store the mean so that a
turn's number stays on the scale of one trajectory's advantage.

Departures from the papers, stated plainly (none of this is validated against the
released TreePO or TreeRL code):

- TreeRL (Hou et al., 2025) also scales a node's advantage by 1/sqrt(n_y) to offset the
  repetition of shared prefixes across paths; that is not applied here.
- ``treepo`` is the plain average of the subgroup-centred rewards, with no std
  normalisation per subgroup or per batch.
- Rewards are used as given (binary in this project); nothing here checks that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_core.algo.tree import (
    ROOT,
    BoolArray,
    FloatArray,
    LogprobArray,
    RolloutTree,
    TokenArray,
    leaf_counts,
    recursive_targets,
    subtree_sums,
)

ESTIMATORS = ("grpo", "drgrpo", "treepo", "treerl")
GRPO_EPS = 1e-6


def turn_advantages(tree: RolloutTree, estimator: str) -> FloatArray:
    """Advantage of every node of ``tree`` under ``estimator``: (n,) float64, root 0."""
    match estimator:
        case "grpo":
            adv = _mean_over_leaves(tree, _grpo_leaf_advantages(tree))
        case "drgrpo":
            adv = _mean_over_leaves(tree, _drgrpo_leaf_advantages(tree))
        case "treepo":
            adv = _mean_over_leaves(tree, _treepo_leaf_advantages(tree))
        case "treerl":
            adv = _treerl_advantages(tree)
        case _:
            raise ValueError(
                f"unknown advantage estimator {estimator!r}; "
                f"expected one of {', '.join(ESTIMATORS)}"
            )
    adv[ROOT] = 0.0
    return adv


# --- leaf-level estimators: (n,) arrays, meaningful at leaves only, 0 elsewhere -----------
def _leaf_rewards(tree: RolloutTree) -> tuple[BoolArray, FloatArray]:
    leaf = tree.leaf_mask
    return leaf, np.where(leaf, np.nan_to_num(tree.reward), 0.0)


def _grpo_leaf_advantages(tree: RolloutTree) -> FloatArray:
    leaf, reward = _leaf_rewards(tree)
    r = reward[leaf]  # (L,)
    adv = np.zeros(tree.size)
    # One leaf, or all equal: no contrast. Tested explicitly rather than trusting r - mean
    # to round to exactly 0 and then dividing by eps.
    if r.size < 2 or np.all(r == r[0]):
        return adv
    adv[leaf] = (r - r.mean()) / (r.std() + GRPO_EPS)
    return adv


def _drgrpo_leaf_advantages(tree: RolloutTree) -> FloatArray:
    leaf, reward = _leaf_rewards(tree)
    r = reward[leaf]
    adv = np.zeros(tree.size)
    if r.size < 2 or np.all(r == r[0]):
        return adv
    adv[leaf] = r - r.mean()
    return adv


def _treepo_leaf_advantages(tree: RolloutTree) -> FloatArray:
    leaf, reward = _leaf_rewards(tree)
    n = leaf_counts(tree)
    v = recursive_targets(tree)  # mean reward of the leaves below each node = mean(G)
    grouped = n > 1  # subgroups of one leaf are skipped
    # Top-down over proper ancestors: how many multi-leaf subgroups lie above each node
    # and the sum of their means. parent[i] < i, so a forward loop sees parents first.
    count = np.zeros(tree.size, dtype=np.int64)
    mean_sum = np.zeros(tree.size)
    for i in range(1, tree.size):
        p = tree.parent[i]
        count[i] = count[p] + grouped[p]
        mean_sum[i] = mean_sum[p] + (v[p] if grouped[p] else 0.0)
    # mean over groups of (r - mean(G)) = r - (Σ mean(G)) / count
    with np.errstate(invalid="ignore", divide="ignore"):
        adv = reward - mean_sum / count
    return np.where(leaf & (count > 0), adv, 0.0)


def _mean_over_leaves(tree: RolloutTree, leaf_adv: FloatArray) -> FloatArray:
    """Each node's mean of ``leaf_adv`` over the leaves of its subtree (0 with none)."""
    total = subtree_sums(tree, np.where(tree.leaf_mask, leaf_adv, 0.0))
    n = leaf_counts(tree)
    return np.where(n > 0, total / np.maximum(n, 1), 0.0)


# --- node-level estimators --------------------------------------------------------------
def _treerl_advantages(tree: RolloutTree) -> FloatArray:
    adv = np.zeros(tree.size)
    if tree.size == 1:
        return adv
    v = recursive_targets(tree)  # every turn node has ≥ 1 leaf below, so no NaN past the root
    turns = v[1:]
    adv[1:] = (turns - v[tree.parent[1:]]) + (turns - v[ROOT])
    return adv


# --- tokens -----------------------------------------------------------------------------
def token_advantages(tree: RolloutTree, adv: FloatArray) -> list[FloatArray]:
    """Per node: ``adv[i]`` on its generated tokens, then 0 on its observation tokens."""
    _check_node_values(tree, adv)
    return [
        np.concatenate(
            [np.full(len(tree.gen_tokens[i]), adv[i]), np.zeros(len(tree.obs_tokens[i]))]
        )
        for i in range(tree.size)
    ]


def token_loss_mask(tree: RolloutTree) -> list[BoolArray]:
    """Per node, aligned with ``token_advantages``: True on generated tokens only."""
    return [
        np.concatenate(
            [np.ones(len(tree.gen_tokens[i]), bool), np.zeros(len(tree.obs_tokens[i]), bool)]
        )
        for i in range(tree.size)
    ]


@dataclass(frozen=True)
class PathTokens:
    """One root-to-leaf trajectory as sampled: prompt, then (generated, observation) per turn.

    All four arrays have one entry per token of that sequence.
    """

    tokens: TokenArray  # token ids, exactly what the engine read and wrote
    advantages: FloatArray  # the turn's advantage on generated tokens, 0 elsewhere
    loss_mask: BoolArray  # True on generated tokens
    logprobs: LogprobArray  # sampling logprob on generated tokens, 0 elsewhere


def path_token_advantages(tree: RolloutTree, leaf: int, adv: FloatArray) -> PathTokens:
    """The root→``leaf`` sequence with its per-token advantages, mask and sampling logprobs."""
    _check_node_values(tree, adv)
    if not (0 <= leaf < tree.size and tree.leaf_mask[leaf]):
        raise ValueError(f"node {leaf} is not a leaf of this tree (size {tree.size})")
    tokens: list[TokenArray] = []
    advantages: list[FloatArray] = []
    mask: list[BoolArray] = []
    logprobs: list[LogprobArray] = []
    for i in tree.path(leaf):
        gen, obs = tree.gen_tokens[i], tree.obs_tokens[i]
        tokens += [gen, obs]
        advantages += [np.full(len(gen), adv[i]), np.zeros(len(obs))]
        mask += [np.ones(len(gen), bool), np.zeros(len(obs), bool)]
        logprobs += [tree.logprobs[i], np.zeros(len(obs), np.float32)]
    return PathTokens(
        tokens=np.concatenate(tokens).astype(np.int32),
        advantages=np.concatenate(advantages).astype(np.float64),
        loss_mask=np.concatenate(mask).astype(bool),
        logprobs=np.concatenate(logprobs).astype(np.float32),
    )


def _check_node_values(tree: RolloutTree, adv: FloatArray) -> None:
    if adv.shape != (tree.size,):
        raise ValueError(
            f"advantages have shape {adv.shape}; expected ({tree.size},), one per node"
        )
