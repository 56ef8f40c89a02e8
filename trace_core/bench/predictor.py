"""``trace-rl bench predictor``: how well does the shared predictor forecast held-out outcomes?

Stored rollout trees (Parquet) are split by prompt id into train and held-out prompts (seeded),
each featurizer's ``SharedPredictor`` is fitted on the train trees, and ``evaluate_predictor``
scores it on the held-out roots and the held-out prefixes no training row shares a token history
with: Brier score and AUC over (node, descendant leaf) pairs, next to the best constant. The
numpy logistic ``HashedFeaturePredictor`` that the other benchmarks use is scored alongside.

    trace-rl rollout --checkpoint build/policy/calc --budget 512 --seed 1 \\
        --output build/pred/trees-1.parquet --metrics build/pred/m-1.json   # a few seeds
    trace-rl bench predictor --trees build/pred --featurizer both --json build/predictor.json

Splitting by prompt rather than by tree keeps a prompt that was drawn twice (two pools, two
seeds) out of both sides at once: a held-out root is a prompt the predictor never saw.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from trace_core.algo.tree import RolloutTree
from trace_core.policy.format import TurnFormat
from trace_core.policy.predictor import FEATURIZERS, PredictorConfig, SharedPredictor
from trace_core.policy.predictor_scores import PredictorReport, evaluate_predictor
from trace_core.rollout.predictor import HashedFeaturePredictor
from trace_core.store.schema import read_trees

REFERENCE = "numpy-logistic"
"""The rollout layer's ``HashedFeaturePredictor``, scored as a reference."""


@dataclass(frozen=True)
class PredictorBenchConfig:
    trees: tuple[Path, ...]
    """Parquet files of rollout trees (see ``tree_paths``)."""
    predictor: PredictorConfig
    """Predictor settings; ``featurizer`` is overridden by each entry of ``featurizers``."""
    featurizers: tuple[str, ...] = ("hashed",)
    heldout: float = 0.25
    """Share of prompt ids held out."""
    seed: int = 0
    """Seeds the split, the head's initial weights and the minibatch order."""
    reference: bool = True
    """Also score the numpy ``HashedFeaturePredictor``."""

    def __post_init__(self) -> None:
        if not self.trees:
            raise ValueError("trees is empty: name Parquet files of rollout trees")
        if not self.featurizers:
            raise ValueError(f"featurizers is empty; name some of {', '.join(FEATURIZERS)}")
        for name in self.featurizers:
            if name not in FEATURIZERS:
                raise ValueError(
                    f"featurizer must be one of {', '.join(FEATURIZERS)}, got {name!r}"
                )
        if not 0 < self.heldout < 1:
            raise ValueError(f"heldout must be in (0, 1), got {self.heldout}")


@dataclass(frozen=True)
class PredictorRun:
    report: PredictorReport
    fit_seconds: float
    """Featurizing and fitting the train rows."""
    train_loss: float
    """Weighted MSE on the training rows after the fit (NaN for the reference)."""


@dataclass(frozen=True)
class PredictorBenchResult:
    config: PredictorBenchConfig
    trees: int
    prompts: int
    train_trees: int
    heldout_trees: int
    runs: dict[str, PredictorRun]

    def to_json(self) -> dict[str, object]:
        c = self.config
        return {
            "config": {
                "trees": [str(p) for p in c.trees],
                "predictor": asdict(c.predictor),
                "featurizers": list(c.featurizers),
                "heldout": c.heldout,
                "seed": c.seed,
            },
            "data": {
                "trees": self.trees,
                "prompts": self.prompts,
                "train_trees": self.train_trees,
                "heldout_trees": self.heldout_trees,
            },
            "predictors": {
                name: {
                    **run.report.to_json(),
                    "fit_seconds": run.fit_seconds,
                    "train_loss": run.train_loss,
                }
                for name, run in self.runs.items()
            },
        }


def tree_paths(spec: str) -> tuple[Path, ...]:
    """A directory (its ``*.parquet``), a file, or a glob pattern, as sorted paths."""
    path = Path(spec)
    found = sorted(path.glob("*.parquet")) if path.is_dir() else sorted(map(Path, glob.glob(spec)))
    if not found:
        raise ValueError(f"no Parquet files of trees at {spec!r} (a directory, file or glob)")
    return tuple(found)


def load_policy_tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the policy that wrote the trees (its ids are what the trees hold)."""
    from trace_core.policy.checkpoint import load_tokenizer

    return load_tokenizer(checkpoint, "--checkpoint")


def predictor_config(
    tokenizer: PreTrainedTokenizerBase, featurizer: str, hidden: int, epochs: int
) -> PredictorConfig:
    """Predictor defaults for a policy: its tokenizer's action-end token marks turns."""
    return PredictorConfig(
        turn_token=TurnFormat(tokenizer).end_of_turn_id,
        featurizer=featurizer,
        hidden=hidden,
        epochs=epochs,
    )


def load_trees(paths: Sequence[Path]) -> list[RolloutTree]:
    return [tree for path in paths for tree in read_trees(path)]


def split_by_prompt(
    trees: Sequence[RolloutTree], heldout: float, rng: np.random.Generator
) -> tuple[list[RolloutTree], list[RolloutTree]]:
    """(train, held-out) trees; a prompt id's trees all land on one side."""
    prompts = sorted({t.info.prompt_id for t in trees})
    count = min(max(1, round(heldout * len(prompts))), len(prompts) - 1)
    held = {prompts[i] for i in rng.permutation(len(prompts))[:count]}
    train = [t for t in trees if t.info.prompt_id not in held]
    return train, [t for t in trees if t.info.prompt_id in held]


def run_predictor_bench(
    config: PredictorBenchConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: Callable[[str], None] = lambda name: None,
) -> PredictorBenchResult:
    """Fit every featurizer's predictor on the train prompts, score on the held-out ones.

    ``tokenizer`` is the policy's; the embedding featurizer needs it to decode token ids.
    """
    trees = load_trees(config.trees)
    prompts = len({t.info.prompt_id for t in trees})
    if prompts < 2:
        raise ValueError(f"need trees of at least 2 prompts to hold some out, got {prompts}")
    train, held = split_by_prompt(trees, config.heldout, np.random.default_rng(config.seed))
    runs: dict[str, PredictorRun] = {}
    for name in config.featurizers:
        progress(name)
        start = time.perf_counter()
        predictor = SharedPredictor(
            replace(config.predictor, featurizer=name),
            generator=torch.Generator().manual_seed(config.seed),
            tokenizer=tokenizer,
        )
        fit = predictor.fit(train, torch.Generator().manual_seed(config.seed + 1))
        seconds = time.perf_counter() - start
        runs[name] = PredictorRun(
            evaluate_predictor(predictor, train, held), seconds, fit.loss_after
        )
    if config.reference:
        progress(REFERENCE)
        start = time.perf_counter()
        reference = HashedFeaturePredictor(turn_token=config.predictor.turn_token)
        reference.observe(train)
        reference.fit()
        seconds = time.perf_counter() - start
        runs[REFERENCE] = PredictorRun(
            evaluate_predictor(reference, train, held), seconds, float("nan")
        )
    return PredictorBenchResult(config, len(trees), prompts, len(train), len(held), runs)
