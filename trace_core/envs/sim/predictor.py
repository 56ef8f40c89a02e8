"""The simulator's success predictor: a logistic model of V on a node's noisy feature and depth.

It plays the role of the paper's shared predictor Ṽ_ψ(H_t): one model scores both roots
(depth 0) and prefixes, and it is refitted after every iteration on the recursive targets
V̂(y) of all trees seen so far. It only ever reads ``SimTree.feature`` and depth, never the
true V.

Departure from the paper: the paper regresses with squared error; we minimise the Bernoulli
cross-entropy to the soft targets V̂(y), weighted by the leaf count n_y (a node averaging n_y
leaves is n_y observations). Both are minimised by the calibrated V; cross-entropy gives a
concave problem that a few Newton steps solve exactly, with no learning rate to tune.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

_MAX_DEPTH = 8.0  # depth scale for the features


def _design(feature: npt.ArrayLike, depth: npt.ArrayLike) -> FloatArray:
    z = np.asarray(feature, dtype=np.float64)
    d = np.asarray(depth, dtype=np.float64) / _MAX_DEPTH
    return np.stack([np.ones_like(z), z, d, z * d], axis=1)  # (n, 4)


def _sigmoid(x: FloatArray) -> FloatArray:
    return np.asarray(0.5 * (1.0 + np.tanh(0.5 * x)))


class FeaturePredictor:
    """V ≈ σ(w · [1, z, d, z·d]); predicts 0.5 everywhere until first fitted."""

    def __init__(self, l2: float = 1e-3, newton_steps: int = 25) -> None:
        self.l2 = l2
        self.newton_steps = newton_steps
        self.weights = np.zeros(4)
        self._x: list[FloatArray] = []
        self._y: list[FloatArray] = []
        self._n: list[FloatArray] = []

    @property
    def fitted(self) -> bool:
        return bool(self._x)

    def predict(self, feature: npt.ArrayLike, depth: npt.ArrayLike) -> FloatArray:
        return _sigmoid(_design(feature, depth) @ self.weights)

    def observe(
        self,
        feature: npt.ArrayLike,
        depth: npt.ArrayLike,
        target: npt.ArrayLike,
        weight: npt.ArrayLike,
    ) -> None:
        """Add training rows: recursive targets V̂ ∈ [0, 1] with leaf-count weights."""
        self._x.append(_design(feature, depth))
        self._y.append(np.asarray(target, dtype=np.float64))
        self._n.append(np.asarray(weight, dtype=np.float64))

    def fit(self) -> None:
        """Newton's method on the weighted cross-entropy of everything observed so far."""
        if not self._x:
            return
        x, y, n = np.concatenate(self._x), np.concatenate(self._y), np.concatenate(self._n)
        w = self.weights.copy()
        ridge = self.l2 * n.sum() * np.eye(x.shape[1])
        for _ in range(self.newton_steps):
            p = _sigmoid(x @ w)
            grad = x.T @ (n * (p - y)) + ridge @ w
            hess = (x * (n * p * (1.0 - p))[:, None]).T @ x + ridge
            step = np.linalg.solve(hess, grad)
            w -= step
            if np.abs(step).max() < 1e-10:
                break
        self.weights = w
