"""Training rows of the success predictor: exact token histories, V̂, n and depth per inner node."""

from __future__ import annotations

import numpy as np
import pytest

from trace_core.algo.prefix import TrainingRows, concat_rows, node_histories, training_rows
from trace_core.algo.tree import TreeBuilder, TreeInfo


def small_tree() -> TreeBuilder:
    """Prompt [1, 2]; a rollout a → b (reward 1), a continuation a → c (reward 0), and a
    second root rollout d (reward 1, a one-turn episode)."""
    builder = TreeBuilder(TreeInfo(prompt_id="p"), prompt_tokens=[1, 2])
    a = builder.add_turn(0, [10, 3], [11])
    b = builder.add_turn(a, [12, 3], [])
    c = builder.add_turn(a, [13, 3], [], branch=True)
    d = builder.add_turn(0, [14, 3], [15])
    for node, reward in ((b, 1.0), (c, 0.0), (d, 1.0)):
        builder.set_reward(node, reward)
    return builder


def test_rows_by_hand() -> None:
    tree = small_tree().build()
    assert node_histories(tree)[2] == [1, 2, 10, 3, 11, 12, 3]
    rows = training_rows([tree, tree])
    # Inner nodes: the root (3 leaves, 2 successes) and a (2 leaves, 1 success); twice.
    assert rows.prefixes[:2] == [[1, 2], [1, 2, 10, 3, 11]]
    assert rows.target.tolist() == pytest.approx([2 / 3, 1 / 2] * 2)
    assert rows.weight.tolist() == [3.0, 2.0] * 2
    assert rows.depth.tolist() == [0, 1] * 2
    assert rows.successes.tolist() == [2.0, 1.0] * 2
    assert len(rows) == 4


def test_lone_root_gives_no_row() -> None:
    assert len(training_rows([TreeBuilder(TreeInfo(), prompt_tokens=[1]).build()])) == 0


def test_select_and_concat() -> None:
    rows = training_rows([small_tree().build()])
    assert rows.select(np.array([False, True])).prefixes == [rows.prefixes[1]]
    assert rows.select(np.array([1, 0])).depth.tolist() == [1, 0]
    both = concat_rows([rows, rows.select(np.array([1]))])
    assert len(both) == 3 and both.weight.tolist() == [3.0, 2.0, 2.0]
    assert len(concat_rows([])) == 0 and concat_rows([]).depth.dtype == np.int64


def test_mismatched_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="depth"):
        TrainingRows([[1]], np.ones(1), np.ones(1), np.zeros(2, np.int64))
