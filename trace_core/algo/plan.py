"""Strategies: where each one spends an equal rollout budget.

Every strategy name used anywhere in the project is a key of ``STRATEGIES``; that table is the
one place that says how a strategy picks prompts (stage 1) and prefixes (stage 2):

| name         | prompts (stage 1)              | prefixes (stage 2) |
|--------------|--------------------------------|--------------------|
| grpo         | uniform, fixed group           | none (flat)        |
| pcl          | predicted V nearest 0.5, fixed | none (flat)        |
| treepo       | uniform, fixed group           | uniform at random  |
| trace        | adaptive (``allocate_roots``)  | predicted flips    |
| trace-root   | adaptive                       | uniform at random  |
| trace-prefix | uniform, fixed group           | predicted flips    |
| trace-auto   | adaptive, and the shape M × N  | predicted flips    |
| oracle       | adaptive, on the true V        | true flips         |

Budget is counted in rollout units: a root rollout costs 1 and a continuation 0.5, so M roots
with N continuations each cost M(1 + N/2). Tree strategies sample M roots and give each prompt
m_i·N continuations; flat strategies spend all M(1 + N/2) units on roots.

``plan`` is stage 1 (root counts for a pool of prompts, from their scores) and
``RootPlan.expand`` stage 2 (one prompt's continuations over its visited prefixes, as soon as
that prompt's roots are done). ``oracle`` is ``trace`` fed the true V: the caller decides what
the scores are, and only the simulator can pass true values. ``trace-auto`` is ``trace`` on the
shape of the iteration's units that ``algo.shape.choose_shape`` picks from the pool's scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from trace_core.algo.allocate import allocate_prefixes, allocate_roots
from trace_core.algo.shape import PRIOR_WORTH, choose_shape
from trace_core.algo.tree import CONTINUATION_UNIT, ROOT_UNIT

IntArray = npt.NDArray[np.int64]

RootRule = Literal["uniform", "nearest-half", "adaptive"]
PrefixRule = Literal["none", "random", "predicted"]


@dataclass(frozen=True)
class Strategy:
    roots: RootRule
    prefixes: PrefixRule
    uses_true_value: bool = False  # only the simulator can run it
    auto_shape: bool = False  # M × N chosen per iteration (algo.shape)

    @property
    def flat(self) -> bool:
        return self.prefixes == "none"

    @property
    def uses_predictor(self) -> bool:
        return not self.uses_true_value and (
            self.roots in ("nearest-half", "adaptive") or self.prefixes == "predicted"
        )


STRATEGIES: dict[str, Strategy] = {
    "grpo": Strategy("uniform", "none"),
    "pcl": Strategy("nearest-half", "none"),
    "treepo": Strategy("uniform", "random"),
    "trace": Strategy("adaptive", "predicted"),
    "trace-root": Strategy("adaptive", "random"),
    "trace-prefix": Strategy("uniform", "predicted"),
    "trace-auto": Strategy("adaptive", "predicted", auto_shape=True),
    "oracle": Strategy("adaptive", "predicted", uses_true_value=True),
}


def strategy(name: str) -> Strategy:
    """The strategy called ``name``; a clear error for anything else."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


MAX_UNITS = 65_536
"""Rollout units one iteration may spend: every tree of an iteration is held in memory, and at
the paper's scale (512 prompts × 8 rollouts) an iteration spends 4,096."""


@dataclass(frozen=True)
class Budget:
    """An equal budget for every strategy, in the shape of the paper (M roots × N continuations)."""

    roots: int
    """M: root rollouts a tree strategy samples per iteration."""
    continuations: int
    """N: continuations per root rollout (each costs half a unit)."""
    group: int = 8
    """Rollouts per prompt of the fixed-group strategies (grpo, pcl, treepo, trace-prefix)."""

    def __post_init__(self) -> None:
        if self.roots < 2:
            raise ValueError(f"roots must be at least 2 (one group), got {self.roots}")
        if self.continuations < 0:
            raise ValueError(f"continuations must be >= 0, got {self.continuations}")
        if self.group < 2:
            raise ValueError(f"group must be at least 2 (GRPO needs a pair), got {self.group}")
        if self.units > MAX_UNITS:
            raise ValueError(
                f"roots × (1 + continuations/2) = {self.units:,.0f} units; at most {MAX_UNITS:,} "
                "fit one iteration (its trees are held in memory): lower roots or continuations"
            )

    @property
    def units(self) -> float:
        return self.roots * (ROOT_UNIT + CONTINUATION_UNIT * self.continuations)

    @property
    def flat_roots(self) -> int:
        """Root rollouts a flat strategy buys with the same units."""
        return int(self.units // ROOT_UNIT)


@dataclass(frozen=True)
class RootPlan:
    """Stage 1 for a pool: root rollouts and continuation budget per prompt."""

    strategy: str
    counts: IntArray  # (B,) root rollouts per prompt, 0 or ≥ 2
    continuations: IntArray  # (B,) continuations prompt i may spend in stage 2

    @property
    def units(self) -> float:
        return ROOT_UNIT * float(self.counts.sum()) + CONTINUATION_UNIT * float(
            self.continuations.sum()
        )

    def expand(
        self,
        prompt: int,
        rewards: npt.ArrayLike,
        values: npt.ArrayLike,
        rng: np.random.Generator,
    ) -> IntArray:
        """Stage 2 for one prompt: continuations per visited prefix.

        ``rewards[p]`` is the reward of the rollout that prefix p lies on and ``values[p]`` the
        prefix's V (predicted, or true for ``oracle``; ignored by random branching). Needs only
        this prompt's rollouts, so it can run while other prompts are still rolling out.
        """
        rule = strategy(self.strategy).prefixes
        r = np.asarray(rewards, dtype=np.float64)
        budget = int(self.continuations[prompt])
        if budget == 0 or len(r) == 0:
            return np.zeros(len(r), dtype=np.int64)
        match rule:
            case "predicted":
                return allocate_prefixes(r, values, budget)
            case "random":
                return rng.multinomial(budget, np.full(len(r), 1.0 / len(r))).astype(np.int64)
            case "none":
                return np.zeros(len(r), dtype=np.int64)


def split_groups(total: int, prompts: int, group: int) -> IntArray:
    """Sizes of fixed groups spending ``total`` rollouts over at most ``prompts`` prompts.

    Groups of ``group``; a leftover of ≥ 2 forms one smaller group, a leftover of 1 joins the
    first group. With too few prompts the groups grow instead.
    """
    if total < 2 or prompts < 1:
        raise ValueError(f"cannot form groups of >= 2 from {total} rollouts and {prompts} prompts")
    n, left = divmod(total, group)
    if n + (left >= 2) > prompts:
        base, extra = divmod(total, prompts)
        if base < 2:
            return split_groups(total, total // 2, 2)
        return np.asarray([base + (i < extra) for i in range(prompts)], dtype=np.int64)
    sizes = [group] * n + ([left] if left >= 2 else [])
    if left == 1:
        sizes[0] += 1
    return np.asarray(sizes, dtype=np.int64)


def plan(
    name: str,
    scores: npt.ArrayLike,
    budget: Budget,
    rng: np.random.Generator,
    worth: float = PRIOR_WORTH,
) -> RootPlan:
    """Stage 1: root rollouts per prompt of a pool.

    ``scores[i]`` is prompt i's success probability as the strategy sees it: the predictor's
    V for the learned strategies, the true V for ``oracle``; uniform strategies ignore it.
    ``worth``: how often a continuation flips against a fresh root (``algo.shape``), which
    ``trace-auto`` weighs its shapes with.
    """
    spec = strategy(name)
    v = np.asarray(scores, dtype=np.float64)
    if spec.auto_shape:
        roots, per_root = choose_shape(v, budget.roots, budget.continuations, worth)
        budget = Budget(roots, per_root, budget.group)
    pool = len(v)
    total = budget.flat_roots if spec.flat else budget.roots
    counts = np.zeros(pool, dtype=np.int64)
    match spec.roots:
        case "adaptive":
            counts = allocate_roots(v, total)
        case "uniform":
            sizes = split_groups(total, pool, budget.group)
            counts[rng.choice(pool, size=len(sizes), replace=False)] = sizes
        case "nearest-half":
            sizes = split_groups(total, pool, budget.group)
            nearest = np.argsort(np.abs(v - 0.5), kind="stable")
            counts[nearest[: len(sizes)]] = sizes
    continuations = np.zeros(pool, dtype=np.int64) if spec.flat else counts * budget.continuations
    return RootPlan(name, counts, continuations)
