"""How well a success predictor forecasts trees it has not trained on: Brier score, skill
against the best constant, AUC and reliability, for roots (stage 1) and prefixes (stage 2).

    report = evaluate_predictor(predictor, train_trees, heldout_trees)
    report.roots.brier_skill, report.prefixes.auc
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from trace_core.algo.forecast import auc, brier_score
from trace_core.algo.prefix import Predictor, TrainingRows, training_rows
from trace_core.algo.tree import RolloutTree

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Forecast:
    """Forecasts ``p`` of nodes with ``successes`` and ``failures`` leaves below each, and the
    constant forecast they are measured against."""

    p: FloatArray
    successes: FloatArray
    failures: FloatArray
    constant: float

    @property
    def brier_skill(self) -> float:
        """1 − Brier ÷ the constant's Brier; NaN without outcomes or against a perfect constant."""
        base = brier_score(np.full(len(self.p), self.constant), self.successes, self.failures)
        if not base > 0:
            return math.nan
        return 1.0 - brier_score(self.p, self.successes, self.failures) / base

    @property
    def auc(self) -> float:
        return auc(self.p, self.successes, self.failures)

    def reliability(self, bins: int = 10) -> list[tuple[float, float, float]]:
        """(mean forecast, observed success rate, outcomes) per non-empty forecast bin of
        width 1/bins, every outcome weighing one: the points of a reliability diagram."""
        index = np.minimum((self.p * bins).astype(int), bins - 1)
        n = self.successes + self.failures
        out = []
        for b in range(bins):
            at = index == b
            total = float(n[at].sum())
            if total > 0:
                mean = float((self.p[at] * n[at]).sum() / total)
                out.append((mean, float(self.successes[at].sum() / total), total))
        return out


@dataclass(frozen=True)
class ForecastScores:
    """Brier score and AUC of one node set, for the predictor and for the constant baseline."""

    nodes: int
    """Evaluated nodes."""
    pairs: int
    """(node, descendant leaf) pairs: the labelled outcomes the scores are over."""
    success_rate: float
    """Share of those pairs whose leaf has reward 1."""
    brier: float
    auc: float
    constant: float
    """The baseline's V: the leaf-weighted mean training target of the same kind of node."""
    brier_constant: float
    auc_constant: float
    """0.5 whenever the set holds both outcomes: a constant ties every pair."""

    @property
    def brier_skill(self) -> float:
        """1 − brier / brier_constant: > 0 means better than the constant."""
        return 1.0 - self.brier / self.brier_constant if self.brier_constant else math.nan


@dataclass(frozen=True)
class PredictorReport:
    """Held-out scores of a predictor on roots and on prefixes it never trained on."""

    roots: ForecastScores
    """Roots of the held-out trees (prompts whose token ids never appear in a training row)."""
    prefixes: ForecastScores
    """Non-root inner nodes of the held-out trees whose token history is no training row's."""
    train_rows: int
    seen_excluded: int
    """Held-out rows left out because a training row has the same token history."""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "train_rows": self.train_rows,
            "seen_excluded": self.seen_excluded,
        }
        for name in ("roots", "prefixes"):
            scores: ForecastScores = getattr(self, name)
            out[name] = {**asdict(scores), "brier_skill": scores.brier_skill}
        return out


def _scores(
    predict: Callable[[Sequence[Sequence[int]]], FloatArray], rows: TrainingRows, constant: float
) -> ForecastScores:
    s = rows.successes
    f = rows.weight - s
    p = predict(rows.prefixes) if len(rows) else np.zeros(0)
    c = np.full(len(rows), constant)
    pairs = float(rows.weight.sum())
    return ForecastScores(
        nodes=len(rows),
        pairs=int(pairs),
        success_rate=float(s.sum() / pairs) if pairs else math.nan,
        brier=brier_score(p, s, f),
        auc=auc(p, s, f),
        constant=constant,
        brier_constant=brier_score(c, s, f),
        auc_constant=auc(c, s, f),
    )


def weighted_mean(rows: TrainingRows) -> float:
    """The rows' leaf-weighted mean target: the best constant forecast of them."""
    return float(rows.successes.sum() / rows.weight.sum()) if rows.weight.sum() else 0.5


def evaluate_predictor(
    predictor: Predictor,
    train_trees: Sequence[RolloutTree],
    heldout_trees: Sequence[RolloutTree],
) -> PredictorReport:
    """Score ``predictor`` on the held-out trees' roots and never-seen prefixes.

    Labels: every evaluated node y is paired with each leaf below it, the pair's label being
    that leaf's reward (0 or 1) and its forecast the predictor's V(y). Brier score and AUC are
    over all these pairs (``trace_core.algo.forecast``), so a node weighs its leaf count n_y,
    as in training, and both are proper scores of binary outcomes. A leaf below several
    evaluated prefixes counts once for each.

    "Unseen" is exact: a held-out row counts only if no training row has the same token
    history (with trees split by prompt that is nearly every row; identical histories can
    recur only when two prompt ids share a text). The baseline is the best constant fitted on
    the training rows of the same kind: the leaf-weighted mean target V̂ of the training roots
    for roots, of the training prefixes for prefixes.
    """
    train = training_rows(train_trees)
    held = training_rows(heldout_trees)
    seen = {tuple(p) for p in train.prefixes}
    unseen = np.asarray([tuple(p) not in seen for p in held.prefixes], dtype=bool)
    root, deeper = held.depth == 0, held.depth > 0
    return PredictorReport(
        roots=_scores(
            predictor.predict_roots,
            held.select(unseen & root),
            weighted_mean(train.select(train.depth == 0)),
        ),
        prefixes=_scores(
            predictor.predict,
            held.select(unseen & deeper),
            weighted_mean(train.select(train.depth > 0)),
        ),
        train_rows=len(train),
        seen_excluded=int((~unseen).sum()),
    )
