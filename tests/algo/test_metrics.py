"""Batch metrics: a hand-built batch with the counts worked out, then brute force on random."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.algo.metrics import BatchMetrics, measure
from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo


def build(edges: list[tuple[int, bool]], rewards: dict[int, float], tokens: int) -> RolloutTree:
    """Turns given as (parent, branch) in id order, each with ``tokens`` generated tokens."""
    b = TreeBuilder(TreeInfo())
    for parent, branch in edges:
        b.add_turn(parent, gen_tokens=[1] * tokens, obs_tokens=[2], branch=branch)
    for node, r in rewards.items():
        b.set_reward(node, r)
    return b.build()


def hand_batch() -> list[RolloutTree]:
    # A: flat GRPO group, rewards [1, 0, 0, 1], 2 generated tokens per turn.
    #    mixed prompt; one anchor (root, 4 children), mixed, pairs 2 × 2 = 4;
    #    units 4 × 1 = 4; tokens 4 × 2 = 8.
    a = build([(0, False)] * 4, {1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0}, tokens=2)
    # B: root rollouts 1→4→6 and 2; continuations 3, 5 (from 1) and 7 (from 4); 1 token a turn.
    #              0
    #            /   \
    #           1     2 r=0
    #         / | \
    #    r=1 3* 4  5* r=0
    #           | \
    #       r=1 6  7* r=1
    #    successes {3, 6, 7}, failures {2, 5} → mixed prompt.
    #    anchors: root (1, 2): s=3, f=2, mixed; pairs 3·2 − (s₁f₁ = 3·1) − (s₂f₂ = 0·1) = 3
    #             node 1 (3, 4, 5): s=3, f=1, mixed; pairs 3·1 − (0 + 2·0 + 0·1) = 3
    #             node 4 (6, 7): s=2, f=0, not mixed; pairs 0
    #    units 2 + 3 × 0.5 = 3.5; tokens 7.
    b = build(
        [(0, False), (0, False), (1, True), (1, False), (1, True), (4, False), (4, True)],
        {2: 0.0, 3: 1.0, 5: 0.0, 6: 1.0, 7: 1.0},
        tokens=1,
    )
    # C: every leaf fails. Root rollouts 1→2 and 3; continuation 4 from 1.
    #    not mixed; anchors root (1, 3) and node 1 (2, 4), neither mixed, pairs 0;
    #    units 2 + 0.5 = 2.5; tokens 4.
    c = build([(0, False), (1, False), (0, False), (1, True)], {2: 0.0, 3: 0.0, 4: 0.0}, tokens=1)
    # D: a prompt the allocator skipped (m = 0): a lone root, counted nowhere.
    d = TreeBuilder(TreeInfo()).build()
    return [a, b, c, d]


def test_hand_batch() -> None:
    m = measure(hand_batch())
    assert m == BatchMetrics(
        prompts=3,  # A, B, C (D has no root rollout)
        prompt_effective_ratio=2 / 3,  # A and B are mixed
        anchors=6,  # A: 1, B: 3, C: 2
        anchor_effective_ratio=0.5,  # mixed: A root, B root, B node 1 → 3 / 6
        mixed_groups=3,
        mixed_per_100_units=30.0,  # 100 × 3 / 10
        contrast_pairs=10,  # 4 + (3 + 3) + 0
        units=10.0,  # 4 + 3.5 + 2.5
        tokens=19,  # 8 + 7 + 4
        root_rollouts=8,  # 4 + 2 + 2
        continuations=4,  # 0 + 3 + 1
    )
    d = m.as_dict()
    assert list(d) == [
        "prompts",
        "prompt_effective_ratio",
        "anchors",
        "anchor_effective_ratio",
        "mixed_groups",
        "mixed_per_100_units",
        "contrast_pairs",
        "units",
        "tokens",
        "root_rollouts",
        "continuations",
        "dropped_prompts",
    ]
    assert all(type(v) is float for v in d.values())
    assert d["contrast_pairs"] == 10.0


@pytest.mark.parametrize("trees", [[], [TreeBuilder(TreeInfo()).build()]])
def test_nothing_rolled_out_is_all_zeros(trees: list[RolloutTree]) -> None:
    assert all(v == 0.0 for v in measure(trees).as_dict().values())


def test_single_rollout_has_no_anchor() -> None:
    # one root rollout: a prompt, unmixed, no sibling group, 1 unit → ratios 0, not NaN
    m = measure([build([(0, False)], {1: 1.0}, tokens=3)])
    assert (m.prompts, m.anchors, m.units, m.tokens) == (1, 0, 1.0, 3)
    assert m.anchor_effective_ratio == 0.0 and m.mixed_per_100_units == 0.0


# --- brute force on random batches -------------------------------------------------------
@st.composite
def random_trees(draw: st.DrawFn, max_turns: int = 16) -> RolloutTree:
    turns = draw(st.integers(0, max_turns))
    b = TreeBuilder(TreeInfo())
    parents = [-1]
    for i in range(1, turns + 1):
        parent = draw(st.integers(0, i - 1))
        parents.append(parent)
        gen = draw(st.integers(0, 3))
        b.add_turn(parent, gen_tokens=[1] * gen, branch=parent != 0 and draw(st.booleans()))
    for node in range(1, turns + 1):
        if node not in parents:
            b.set_reward(node, draw(st.sampled_from([0.0, 1.0])))
    return b.build()


def ref_path(parent: list[int], y: int) -> list[int]:
    nodes = [y]
    while nodes[-1] != 0:
        nodes.append(parent[nodes[-1]])
    return nodes[::-1]


def ref_measure(trees: list[RolloutTree]) -> dict[str, float]:
    """Counts by enumeration: children lists, leaf pairs and their deepest shared node."""
    out = dict.fromkeys(BatchMetrics.__dataclass_fields__, 0.0)
    mixed_prompts = 0
    for tree in trees:
        parent = [int(p) for p in tree.parent]
        kids = {y: [c for c in range(1, len(parent)) if parent[c] == y] for y in range(len(parent))}
        if not kids[0]:
            continue
        out["prompts"] += 1

        leaves = [y for y in range(1, len(parent)) if not kids[y]]
        wins = [y for y in leaves if tree.reward[y] == 1.0]
        losses = [y for y in leaves if tree.reward[y] == 0.0]
        mixed_prompts += bool(wins and losses)
        for y, ks in kids.items():
            if len(ks) < 2:
                continue
            out["anchors"] += 1
            below = [leaf for leaf in leaves if y in ref_path(parent, leaf)]
            rs = {float(tree.reward[leaf]) for leaf in below}
            out["mixed_groups"] += rs == {0.0, 1.0}
        for w, f in itertools.product(wins, losses):
            pw, pf = ref_path(parent, w), ref_path(parent, f)
            shared = [a for a, b in zip(pw, pf, strict=False) if a == b]
            assert len(kids[shared[-1]]) >= 2  # two leaves always split at an anchor
            out["contrast_pairs"] += 1
        for y in range(1, len(parent)):
            out["root_rollouts"] += parent[y] == 0
            out["continuations"] += bool(tree.branch[y])
            out["units"] += 1.0 if parent[y] == 0 else 0.5 if tree.branch[y] else 0.0
            out["tokens"] += len(tree.gen_tokens[y])
    if out["prompts"]:
        out["prompt_effective_ratio"] = mixed_prompts / out["prompts"]
    if out["anchors"]:
        out["anchor_effective_ratio"] = out["mixed_groups"] / out["anchors"]
    if out["units"]:
        out["mixed_per_100_units"] = 100 * out["mixed_groups"] / out["units"]
    return out


@settings(max_examples=60, deadline=None)
@given(trees=st.lists(random_trees(), max_size=4))
def test_measure_matches_enumeration(trees: list[RolloutTree]) -> None:
    got, want = measure(trees).as_dict(), ref_measure(trees)
    assert got.keys() == want.keys()
    for key in got:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)
