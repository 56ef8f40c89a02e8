"""Success predictors V(prefix) over token ids, and their training rows from rollout trees.

TRACE scores prompts (stage 1) and prefixes (stage 2) with one shared predictor Ṽ_ψ(H_t),
fitted on the recursive targets V̂(y) of earlier trees. ``HashedFeaturePredictor`` is a small
honest instance: a logistic model on hashed unigram and bigram counts of the prefix plus its
turn count. It sees exactly what the policy saw (the token history), nothing else, and it
learns what makes a prompt hard (long numbers, many operations) and what a turn revealed (an
``error`` observation, a result that looks wrong).

Departure from the paper: the paper regresses with squared error; we minimise the Bernoulli
cross-entropy to the soft targets V̂(y), weighted by leaf count n_y (both are minimised by the
calibrated V). Not yet validated beyond the synthetic tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from trace_core.algo.prefix import TrainingRows, training_rows
from trace_core.algo.shape import PRIOR_WORTH, continuation_worth
from trace_core.algo.tree import RolloutTree

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ConstantPredictor:
    """The same V everywhere: what a strategy sees before any predictor is trained."""

    value: float = 0.5
    continuation_worth: float = PRIOR_WORTH

    def predict(self, prefixes: Sequence[Sequence[int]]) -> FloatArray:
        return np.full(len(prefixes), self.value)

    def predict_roots(self, prompts: Sequence[Sequence[int]]) -> FloatArray:
        return self.predict(prompts)


@dataclass
class HashedFeaturePredictor:
    """σ(w · φ(prefix)): φ = hashed unigram and bigram counts (log1p) and the turn count."""

    turn_token: int
    """Token that ends a turn (the action-end id): its count is the prefix's depth."""
    buckets: int = 2048
    l2: float = 1e-2
    steps: int = 300
    lr: float = 0.2
    continuation_worth: float = PRIOR_WORTH
    """``algo.shape``'s ω, measured on the observed trees (``observe``)."""
    weights: FloatArray = field(init=False)
    _rows: list[TrainingRows] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.weights = np.zeros(self.buckets + 2)

    def features(self, prefixes: Sequence[Sequence[int]]) -> FloatArray:
        x = np.zeros((len(prefixes), self.buckets + 2))  # (N, buckets + bias + depth)
        for i, prefix in enumerate(prefixes):
            ids = np.asarray(prefix, dtype=np.int64)
            grams = np.concatenate([ids * 1_000_003, ids[:-1] * 7_919 + ids[1:] * 104_729])
            np.add.at(x[i], grams % self.buckets, 1.0)
            x[i, -1] = np.count_nonzero(ids == self.turn_token)
        x[:, : self.buckets] = np.log1p(x[:, : self.buckets])
        x[:, -2] = 1.0
        return x

    def predict(self, prefixes: Sequence[Sequence[int]]) -> FloatArray:
        if not len(prefixes):
            return np.zeros(0)
        return _sigmoid(self.features(prefixes) @ self.weights)

    def predict_roots(self, prompts: Sequence[Sequence[int]]) -> FloatArray:
        return self.predict(prompts)

    def observe(self, trees: Sequence[RolloutTree]) -> None:
        self._rows.append(training_rows(trees))
        measured = continuation_worth(trees)
        if measured is not None:
            self.continuation_worth = 0.5 * (self.continuation_worth + measured)

    def fit(self) -> None:
        """Full-batch Adam on the weighted cross-entropy of every row observed so far."""
        prefixes = [p for rows in self._rows for p in rows.prefixes]
        if not prefixes:
            return
        x = self.features(prefixes)
        y = np.concatenate([rows.target for rows in self._rows])
        n = np.concatenate([rows.weight for rows in self._rows])
        n = n / n.sum()
        w, m, s = self.weights.copy(), np.zeros_like(self.weights), np.zeros_like(self.weights)
        for t in range(1, self.steps + 1):
            grad = x.T @ (n * (_sigmoid(x @ w) - y)) + self.l2 * w
            m = 0.9 * m + 0.1 * grad
            s = 0.999 * s + 0.001 * grad**2
            w -= self.lr * (m / (1 - 0.9**t)) / (np.sqrt(s / (1 - 0.999**t)) + 1e-8)
        self.weights = w


def _sigmoid(x: FloatArray) -> FloatArray:
    return np.asarray(0.5 * (1.0 + np.tanh(0.5 * x)))
