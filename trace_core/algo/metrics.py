"""Batch metrics of one iteration: how much reward contrast the rollout budget bought.

``measure(trees)`` summarises the rollout trees of one iteration as ``BatchMetrics``:

- the paper's effective ratio, per prompt: the share of rolled-out prompts whose leaves
  hold both a success and a failure;
- the same per anchor: the share of sibling groups (the root when it has ≥ 2 rollouts, and
  every branched prefix; see ``tree.sibling_groups``) whose leaves are mixed, with the
  count of mixed groups per 100 rollout units and the number of (success, failure) leaf
  pairs that first split at an anchor;
- the budget: rollout units (1 per root rollout, 0.5 per continuation) and generated tokens.

A prompt the allocator skipped (a lone root, m_i = 0) counts in none of these. Ratios over
an empty denominator are 0, so an empty batch measures all zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, sibling_groups, success_counts


@dataclass(frozen=True)
class BatchMetrics:
    """Contrast and cost of one iteration's rollout trees."""

    prompts: int  # trees with at least one root rollout
    prompt_effective_ratio: float  # mixed prompts / prompts (the paper's effective ratio)
    anchors: int  # sibling groups: roots with ≥ 2 rollouts and branched prefixes
    anchor_effective_ratio: float  # mixed_groups / anchors
    mixed_groups: int  # anchors whose leaves hold both a success and a failure
    mixed_per_100_units: float  # 100 × mixed_groups / units
    contrast_pairs: int  # (success, failure) leaf pairs, counted at the anchor where they split
    units: float  # rollout units: 1 per root rollout, 0.5 per continuation
    tokens: int  # generated tokens
    root_rollouts: int
    continuations: int
    dropped_prompts: int = 0  # prompts whose env failed: their trees left out (rollout.grow)

    def as_dict(self) -> dict[str, float]:
        """Every field as a float, keyed by field name (for loggers and reports)."""
        return {name: float(value) for name, value in asdict(self).items()}


def measure(trees: Sequence[RolloutTree]) -> BatchMetrics:
    """Effective ratios, contrast and cost over one iteration's ``trees``."""
    prompts = mixed_prompts = anchors = mixed_groups = pairs = 0
    tokens = root_rollouts = continuations = 0
    units = 0.0
    for tree in trees:
        if tree.root_rollouts == 0:
            continue  # skipped prompt: nothing sampled, nothing spent
        prompts += 1
        successes = int(success_counts(tree)[ROOT])
        failures = int(leaf_counts(tree)[ROOT]) - successes
        mixed_prompts += successes > 0 and failures > 0
        for group in sibling_groups(tree):
            anchors += 1
            mixed_groups += group.mixed
            pairs += group.contrast_pairs
        units += tree.units
        tokens += tree.generated_tokens
        root_rollouts += tree.root_rollouts
        continuations += tree.continuations
    return BatchMetrics(
        prompts=prompts,
        prompt_effective_ratio=_ratio(mixed_prompts, prompts),
        anchors=anchors,
        anchor_effective_ratio=_ratio(mixed_groups, anchors),
        mixed_groups=mixed_groups,
        mixed_per_100_units=100.0 * _ratio(mixed_groups, units),
        contrast_pairs=pairs,
        units=units,
        tokens=tokens,
        root_rollouts=root_rollouts,
        continuations=continuations,
    )


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0
