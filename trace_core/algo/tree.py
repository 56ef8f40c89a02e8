"""Rollout trees: one prompt, its root rollouts, and the continuations branched from their prefixes.

Node 0 is the root and holds the prompt. Every other node is one ReAct turn
(thought + action, then the environment's observation) and points at its parent, so a
root-to-node path is exactly the prefix history H_t = (x, n_1, ..., n_t) of the paper.
Ids are dense integers with ``parent[i] < i``: a plain loop from the last node to the
first visits children before parents, which is all the bottom-up recursions below need.

A turn node keeps what was sampled, not a re-tokenisation of it: the generated token ids,
their sampling logprobs, and the observation token ids appended after them. The root
keeps the prompt token ids in ``obs_tokens`` (the model reads them, it never generates
them). A leaf is the last turn of an episode and keeps its reward; inner nodes have NaN.

``branch[i]`` is True when node i is the first turn of a continuation sampled from a
prefix (stage 2 of TRACE) rather than the next turn of the rollout that created the
prefix. With it the cost of a tree in rollout units is recoverable from the tree alone:
one unit per root rollout, half a unit per continuation.

``truncated[i]`` is True when turn i was cut by the per-turn token limit before its end-of-turn
token; the closing token then starts its observation ids (``policy.format``).

Everything here is numpy and the standard library (see ``tests/algo/test_boundary.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import numpy as np
import numpy.typing as npt

ROOT = 0
NO_PARENT = -1
ROOT_UNIT = 1.0
CONTINUATION_UNIT = 0.5

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
TokenArray = npt.NDArray[np.int32]
LogprobArray = npt.NDArray[np.float32]
_T = TypeVar("_T")


@dataclass(frozen=True, eq=False)
class TreeInfo:
    """Where a tree comes from: every Parquet row of the tree repeats these."""

    run_id: str = "local"
    iteration: int = 0
    prompt_id: str = ""
    tree_id: int = 0
    strategy: str = ""
    policy_version: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeInfo):
            return NotImplemented
        return (
            self.run_id,
            self.iteration,
            self.prompt_id,
            self.tree_id,
            self.strategy,
            self.policy_version,
        ) == (
            other.run_id,
            other.iteration,
            other.prompt_id,
            other.tree_id,
            other.strategy,
            other.policy_version,
        )

    def __hash__(self) -> int:
        return hash((self.run_id, self.iteration, self.prompt_id, self.tree_id))


@dataclass(frozen=True, eq=False)
class RolloutTree:
    """One prompt's rollout tree, one entry per node in every per-node field."""

    info: TreeInfo
    parent: IntArray  # (n,) parent[0] == -1, parent[i] < i
    gen_tokens: tuple[TokenArray, ...]  # generated token ids per node (empty at the root)
    obs_tokens: tuple[TokenArray, ...]  # observation token ids per node (prompt at the root)
    logprobs: tuple[LogprobArray, ...]  # sampling logprob per generated token
    text: tuple[str, ...]  # generated text (prompt text at the root)
    observation: tuple[str, ...]  # observation text ("" at the root)
    reward: FloatArray  # (n,) reward at leaves, NaN elsewhere
    predicted_v: FloatArray  # (n,) predictor's V at scoring time, NaN if not scored
    branch: BoolArray  # (n,) first turn of a continuation from a prefix
    truncated: BoolArray  # (n,) turn cut by the token limit before it ended

    def __post_init__(self) -> None:
        n = len(self.parent)
        if n == 0:
            raise ValueError("a rollout tree needs at least the root node")
        if self.parent[0] != NO_PARENT:
            raise ValueError(f"node 0 must be the root (parent -1), got parent {self.parent[0]}")
        ids = np.arange(n)
        bad = np.flatnonzero((self.parent[1:] < 0) | (self.parent[1:] >= ids[1:]))
        if bad.size:
            i = int(bad[0]) + 1
            raise ValueError(f"node {i}: parent {self.parent[i]} must be in [0, {i})")
        for name in ("gen_tokens", "obs_tokens", "logprobs", "text", "observation"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} nodes")
        for name in ("reward", "predicted_v", "branch", "truncated"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected ({n},)")
        for i in range(n):
            if self.gen_tokens[i].dtype != np.int32 or self.obs_tokens[i].dtype != np.int32:
                raise ValueError(f"node {i}: token ids must be int32 arrays")
            if self.logprobs[i].dtype != np.float32:
                raise ValueError(f"node {i}: logprobs must be a float32 array")
            if len(self.logprobs[i]) != len(self.gen_tokens[i]):
                raise ValueError(
                    f"node {i}: {len(self.logprobs[i])} logprobs for "
                    f"{len(self.gen_tokens[i])} generated tokens"
                )
        leaf = self.leaf_mask
        if np.isnan(self.reward[leaf]).any():
            i = int(np.flatnonzero(leaf & np.isnan(self.reward))[0])
            raise ValueError(f"node {i} is a leaf without a reward")
        rewarded = np.isfinite(self.reward)
        if not np.isin(self.reward[rewarded], (0.0, 1.0)).all():
            i = int(np.flatnonzero(rewarded & ~np.isin(self.reward, (0.0, 1.0)))[0])
            raise ValueError(f"node {i}: reward {float(self.reward[i])!r} is not 0 or 1")
        if np.isfinite(self.reward[~leaf]).any():
            i = int(np.flatnonzero(~leaf & np.isfinite(self.reward))[0])
            raise ValueError(f"node {i} has children and a reward; only leaves hold rewards")
        if self.branch[0] or (self.branch & (self.parent == ROOT)).any():
            raise ValueError("a branch node starts a continuation from a turn, not from the root")
        if self.truncated[0]:
            raise ValueError("the root holds the prompt; only a turn can be truncated")

    # --- shape -----------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.parent)

    @cached_property
    def leaf_mask(self) -> BoolArray:
        """Nodes without children. A lone root (nothing sampled) is not a leaf."""
        has_child = np.zeros(self.size, dtype=bool)
        has_child[self.parent[1:]] = True
        leaf = ~has_child
        leaf[ROOT] = False
        return leaf

    @cached_property
    def depth(self) -> IntArray:
        """Turns from the root: 0 for the root, t for the node ending turn t."""
        depth = np.zeros(self.size, dtype=np.int64)
        for i in range(1, self.size):
            depth[i] = depth[self.parent[i]] + 1
        return depth

    def children(self) -> list[IntArray]:
        """Children of every node, in id order."""
        order = np.argsort(self.parent[1:], kind="stable") + 1
        counts = np.bincount(self.parent[1:], minlength=self.size)
        return np.split(order, np.cumsum(counts)[:-1])

    def path(self, node: int) -> IntArray:
        """Node ids from the root down to ``node``."""
        out = [node]
        while out[-1] != ROOT:
            out.append(int(self.parent[out[-1]]))
        return np.asarray(out[::-1], dtype=np.int64)

    # --- budget ----------------------------------------------------------------------
    @property
    def root_rollouts(self) -> int:
        return int(np.count_nonzero(self.parent == ROOT))

    @property
    def continuations(self) -> int:
        return int(np.count_nonzero(self.branch))

    @property
    def units(self) -> float:
        """Rollout units spent on this tree: 1 per root rollout, 0.5 per continuation."""
        return ROOT_UNIT * self.root_rollouts + CONTINUATION_UNIT * self.continuations

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.gen_tokens)

    def reordered(self, order: Sequence[int]) -> RolloutTree:
        """The same tree with its nodes numbered in ``order`` (old ids, the root first, every
        parent before its children)."""
        old = np.asarray(order, dtype=np.int64)
        if len(old) != self.size or sorted(old.tolist()) != list(range(self.size)):
            raise ValueError(f"order must list each of the {self.size} nodes once")
        new = np.empty(self.size, dtype=np.int64)
        new[old] = np.arange(self.size)
        parent = np.where(self.parent[old] == NO_PARENT, NO_PARENT, new[self.parent[old]])
        if old[0] != 0 or np.any(parent[1:] >= np.arange(1, self.size)):
            raise ValueError("order must start at the root and put every parent first")

        def pick(values: tuple[_T, ...]) -> tuple[_T, ...]:
            return tuple(values[int(i)] for i in old)

        return RolloutTree(
            info=self.info,
            parent=parent,
            gen_tokens=pick(self.gen_tokens),
            obs_tokens=pick(self.obs_tokens),
            logprobs=pick(self.logprobs),
            text=pick(self.text),
            observation=pick(self.observation),
            reward=self.reward[old],
            predicted_v=self.predicted_v[old],
            branch=self.branch[old],
            truncated=self.truncated[old],
        )

    def equals(self, other: RolloutTree) -> bool:
        """Exact equality of every field (NaN equals NaN)."""
        return (
            self.info == other.info
            and np.array_equal(self.parent, other.parent)
            and np.array_equal(self.reward, other.reward, equal_nan=True)
            and np.array_equal(self.predicted_v, other.predicted_v, equal_nan=True)
            and np.array_equal(self.branch, other.branch)
            and np.array_equal(self.truncated, other.truncated)
            and self.text == other.text
            and self.observation == other.observation
            and all(
                np.array_equal(a, b)
                for mine, theirs in (
                    (self.gen_tokens, other.gen_tokens),
                    (self.obs_tokens, other.obs_tokens),
                )
                for a, b in zip(mine, theirs, strict=True)
            )
            and all(
                np.array_equal(a, b, equal_nan=True)
                for a, b in zip(self.logprobs, other.logprobs, strict=True)
            )
        )


@dataclass
class TreeBuilder:
    """Grows a tree one turn at a time; ``build()`` freezes it into a ``RolloutTree``."""

    info: TreeInfo
    prompt_tokens: TokenArray = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_text: str = ""
    _parent: list[int] = field(init=False)
    _gen: list[TokenArray] = field(init=False)
    _obs: list[TokenArray] = field(init=False)
    _logprobs: list[LogprobArray] = field(init=False)
    _text: list[str] = field(init=False)
    _observation: list[str] = field(init=False)
    _reward: dict[int, float] = field(init=False)
    _predicted: dict[int, float] = field(init=False)
    _branch: set[int] = field(init=False)
    _truncated: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self._parent = [NO_PARENT]
        self._gen = [np.zeros(0, np.int32)]
        self._obs = [np.asarray(self.prompt_tokens, dtype=np.int32)]
        self._logprobs = [np.zeros(0, np.float32)]
        self._text = [self.prompt_text]
        self._observation = [""]
        self._reward = {}
        self._predicted = {}
        self._branch = set()
        self._truncated = set()

    @property
    def size(self) -> int:
        return len(self._parent)

    def add_turn(
        self,
        parent: int,
        gen_tokens: npt.ArrayLike = (),
        obs_tokens: npt.ArrayLike = (),
        logprobs: npt.ArrayLike | None = None,
        text: str = "",
        observation: str = "",
        *,
        branch: bool = False,
        truncated: bool = False,
    ) -> int:
        """Append a turn under ``parent`` and return its id."""
        if not 0 <= parent < self.size:
            raise ValueError(f"parent {parent} is not a node of this tree (size {self.size})")
        gen = np.asarray(gen_tokens, dtype=np.int32).reshape(-1)
        lp = (
            np.zeros(len(gen), np.float32)
            if logprobs is None
            else np.asarray(logprobs, dtype=np.float32).reshape(-1)
        )
        node = self.size
        self._parent.append(parent)
        self._gen.append(gen)
        self._obs.append(np.asarray(obs_tokens, dtype=np.int32).reshape(-1))
        self._logprobs.append(lp)
        self._text.append(text)
        self._observation.append(observation)
        if branch:
            self._branch.add(node)
        if truncated:
            self._truncated.add(node)
        return node

    def set_reward(self, node: int, reward: float) -> None:
        self._reward[node] = float(reward)

    def set_predicted_v(self, node: int, v: float) -> None:
        self._predicted[node] = float(v)

    def build(self) -> RolloutTree:
        n = self.size
        reward = np.full(n, np.nan)
        for node, r in self._reward.items():
            reward[node] = r
        predicted = np.full(n, np.nan)
        for node, v in self._predicted.items():
            predicted[node] = v
        branch = np.zeros(n, dtype=bool)
        branch[list(self._branch)] = True
        truncated = np.zeros(n, dtype=bool)
        truncated[list(self._truncated)] = True
        return RolloutTree(
            info=self.info,
            parent=np.asarray(self._parent, dtype=np.int64),
            gen_tokens=tuple(self._gen),
            obs_tokens=tuple(self._obs),
            logprobs=tuple(self._logprobs),
            text=tuple(self._text),
            observation=tuple(self._observation),
            reward=reward,
            predicted_v=predicted,
            branch=branch,
            truncated=truncated,
        )


# --- recursions over a tree ------------------------------------------------------------
def subtree_sums(tree: RolloutTree, values: npt.ArrayLike) -> FloatArray:
    """Σ of ``values`` over every node's subtree (the node included).

    One vectorised step per depth level, deepest first: each level adds its totals into
    its parents, which are all one level up.
    """
    total = np.array(values, dtype=np.float64)
    depth = tree.depth
    for d in range(int(depth.max()), 0, -1):
        level = np.flatnonzero(depth == d)
        np.add.at(total, tree.parent[level], total[level])
    return total


def leaf_counts(tree: RolloutTree) -> IntArray:
    """n_y: the number of leaves below (or at) every node."""
    return subtree_sums(tree, tree.leaf_mask).astype(np.int64)


def success_counts(tree: RolloutTree) -> IntArray:
    """Leaves below (or at) every node whose reward is 1."""
    return subtree_sums(tree, tree.leaf_mask & (tree.reward == 1.0)).astype(np.int64)


def recursive_targets(tree: RolloutTree) -> FloatArray:
    """V̂(y) = (1/n_y) Σ_c n_c V̂(c), with V̂(leaf) = its reward.

    Unrolled, V̂(y) is the mean reward of the leaves below y, which is how it is computed:
    two subtree sums and one division. NaN where n_y = 0 (a root with nothing sampled).
    """
    n = leaf_counts(tree)
    total = subtree_sums(tree, np.where(tree.leaf_mask, tree.reward, 0.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)


@dataclass(frozen=True)
class SiblingGroup:
    """An anchor (a node with two or more children) and the children sampled from it."""

    anchor: int
    children: IntArray
    mixed: bool  # the leaves below hold both outcomes (equivalently, contrast_pairs > 0)
    contrast_pairs: int  # (success, failure) leaf pairs whose deepest shared node is the anchor


def sibling_groups(tree: RolloutTree) -> list[SiblingGroup]:
    """Every anchor of the tree: the root when it has ≥ 2 rollouts, and each branched prefix."""
    n = leaf_counts(tree)
    s = success_counts(tree)
    f = n - s
    groups = []
    for anchor, kids in enumerate(tree.children()):
        if len(kids) < 2:
            continue
        # Pairs across different children: all pairs below the anchor minus those
        # that stay inside one child's subtree (those meet deeper down).
        pairs = int(s[anchor] * f[anchor] - np.sum(s[kids] * f[kids]))
        groups.append(SiblingGroup(anchor, kids, bool(s[anchor] > 0 and f[anchor] > 0), pairs))
    return groups


def rollout_prefixes(tree: RolloutTree) -> IntArray:
    """Non-terminal turn nodes reached by root rollouts: the stage-2 branching candidates.

    A prefix H_t with 1 ≤ t < T lies on a root rollout's path (no branch above it)
    and is not a leaf. The root itself is excluded: re-sampling from the root is a
    root rollout, paid for by stage 1.
    """
    on_root_rollout = np.ones(tree.size, dtype=bool)
    for i in range(1, tree.size):
        on_root_rollout[i] = on_root_rollout[tree.parent[i]] and not tree.branch[i]
    inner = ~tree.leaf_mask
    inner[ROOT] = False
    return np.flatnonzero(on_root_rollout & inner).astype(np.int64)
