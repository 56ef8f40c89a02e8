"""Prefix histories H_t of tree nodes, with the value targets a success predictor regresses on.

Every inner node of a rollout tree (the root and each non-terminal turn) is one training row:
its exact token history (the prompt, then every generated and observation token on the path,
never re-tokenised), its recursive target V̂(y) (the mean reward of the leaves below it), its
leaf count n_y and its depth t. The predictor that fits these rows lives in the policy layer
(``trace_core.policy.predictor``); the rows and the ``Predictor`` protocol are pure numpy so that
every layer can use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, recursive_targets

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class Predictor(Protocol):
    """V(prefix): success probability for a batch of token-id prefixes."""

    def predict(self, prefixes: Sequence[Sequence[int]]) -> FloatArray: ...

    def predict_roots(self, prompts: Sequence[Sequence[int]]) -> FloatArray:
        """V of prompts, for stage 1: ``predict`` unless the predictor has a head for them."""
        ...

    @property
    def continuation_worth(self) -> float:
        """How often a continuation flips against a fresh root (``algo.shape``'s ω)."""
        ...


@dataclass(frozen=True)
class TrainingRows:
    """Prefixes with their recursive targets V̂, leaf-count weights n and depths."""

    prefixes: list[list[int]]
    target: FloatArray  # (R,) V̂: mean reward of the leaves below the node
    weight: FloatArray  # (R,) n: leaves below the node
    depth: IntArray  # (R,) turns from the root: 0 for a root (a prompt), t for a prefix H_t

    def __post_init__(self) -> None:
        rows = len(self.prefixes)
        for name in ("target", "weight", "depth"):
            if getattr(self, name).shape != (rows,):
                raise ValueError(
                    f"{name} has shape {getattr(self, name).shape} for {rows} prefixes"
                )

    def __len__(self) -> int:
        return len(self.prefixes)

    @property
    def successes(self) -> FloatArray:
        """Leaves below each node with reward 1: n·V̂ (an integer up to rounding)."""
        return np.asarray(np.rint(self.target * self.weight))

    def select(self, keep: npt.NDArray[np.bool_] | IntArray) -> TrainingRows:
        """The rows at ``keep`` (a mask or indices), in that order."""
        index = np.flatnonzero(keep) if np.asarray(keep).dtype == np.bool_ else np.asarray(keep)
        return TrainingRows(
            [self.prefixes[int(i)] for i in index],
            self.target[index],
            self.weight[index],
            self.depth[index],
        )


def concat_rows(parts: Sequence[TrainingRows]) -> TrainingRows:
    """All rows of ``parts``, in order."""
    return TrainingRows(
        [p for rows in parts for p in rows.prefixes],
        np.concatenate([np.zeros(0), *(rows.target for rows in parts)]),
        np.concatenate([np.zeros(0), *(rows.weight for rows in parts)]),
        np.concatenate([np.zeros(0, np.int64), *(rows.depth for rows in parts)]),
    )


def node_histories(tree: RolloutTree) -> list[list[int]]:
    """The token history after every node: prompt, then generated + observation tokens."""
    history: list[list[int]] = [[int(t) for t in tree.obs_tokens[ROOT]]]
    for node in range(1, tree.size):
        history.append(
            [
                *history[int(tree.parent[node])],
                *(int(t) for t in tree.gen_tokens[node]),
                *(int(t) for t in tree.obs_tokens[node]),
            ]
        )
    return history


def training_rows(trees: Sequence[RolloutTree]) -> TrainingRows:
    """Every inner node of every tree (the root and each non-terminal turn) as a training row.

    A node's prefix is the exact token history the policy continued from after it: the
    prompt, then every generated and observation token on the path. Rows come tree by tree,
    in node-id order (so a tree's root row comes first).
    """
    prefixes: list[list[int]] = []
    targets: list[float] = []
    weights: list[float] = []
    depths: list[int] = []
    for tree in trees:
        v, n = recursive_targets(tree), leaf_counts(tree)
        history = node_histories(tree)
        for node in np.flatnonzero(~tree.leaf_mask & (n > 0)):
            prefixes.append(history[int(node)])
            targets.append(float(v[node]))
            weights.append(float(n[node]))
            depths.append(int(tree.depth[node]))
    return TrainingRows(
        prefixes,
        np.asarray(targets, dtype=np.float64),
        np.asarray(weights, dtype=np.float64),
        np.asarray(depths, dtype=np.int64),
    )
