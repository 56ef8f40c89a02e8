"""The report step: every iteration's trees, found through the run's state, in one tree view,
and a Markdown summary that says where they are and how to open them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.store.schema import write_trees
from trace_core.train.config import TrainConfig
from trace_core.train.contract import TREES, PipelineConfig
from trace_core.train.steps.finish import TREE_URIS, read_tree_uris, record_trees, report_step

EVAL = {"k": 1, "pass1": {"all": 0.5}, "mean_k": {"all": 0.5}, "parse_rate": 1.0, "tasks": 2}


def tree(iteration: int, tree_id: int, rewards: tuple[int, ...]) -> RolloutTree:
    """A prompt with one root rollout per reward."""
    info = TreeInfo("run-r", iteration, f"p{tree_id}", tree_id, "trace", iteration)
    b = TreeBuilder(info, prompt_tokens=np.arange(3, dtype=np.int32), prompt_text="2+3?")
    for reward in rewards:
        node = b.add_turn(0, [5, 6], [], [-0.5, -0.5], text=f"answer[{4 + reward}]")
        b.set_reward(node, reward)
    return b.build()


def trees_folder(folder: Path, trees: list[RolloutTree]) -> str:
    folder.mkdir(parents=True)
    write_trees(folder / TREES, trees)
    return str(folder)


def test_each_state_carries_where_every_iterations_trees_are(tmp_path: Path) -> None:
    states = [tmp_path / f"state-{i}" for i in range(3)]
    for state in states:
        state.mkdir()
    record_trees(states[0], states[1], 1, "s3://bucket/run/iterate/trees")
    record_trees(states[1], states[2], 2, "/runs/iterate-2/trees")
    assert read_tree_uris(states[0]) == {}
    assert read_tree_uris(states[2]) == {
        1: "s3://bucket/run/iterate/trees",
        2: "/runs/iterate-2/trees",
    }
    (states[0] / TREE_URIS).write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"state-0/tree_uris.json: not a map of iteration"):
        read_tree_uris(states[0])


def test_the_report_shows_every_iteration_and_names_one_it_could_not_read(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    first = trees_folder(tmp_path / "it-1", [tree(1, 0, (1, 1)), tree(1, 1, (0, 1))])
    gone = str(tmp_path / "it-2")  # an artifact removed since
    last = trees_folder(tmp_path / "it-3", [tree(3, 0, (0, 1, 1)), tree(3, 1, (0, 0))])
    for i, uri in ((1, first), (2, gone), (3, last)):
        record_trees(state, state, i, uri)
    config = PipelineConfig(TrainConfig(task="calc"))
    html, markdown = tmp_path / "view.html", tmp_path / "summary.md"
    report_step(config, Path(last), state, EVAL, EVAL, html, markdown, sample=1)

    page = html.read_text()
    assert "iterations 1–3, the 1 most mixed trees of each" in page
    assert page.count('<section class="tree"') == 2  # the most mixed of 1 and of 3
    assert "· iteration 1 ·" in page and "· iteration 3 ·" in page
    summary = markdown.read_text()
    assert f"| 1 | `{first}` |" in summary and f"| 3 | `{last}` |" in summary
    assert f"Iteration 2's trees could not be read: {gone}: " in summary
    assert f"trace-rl inspect html {last} 0 1 -o trees.html" in summary
    assert f"trace-rl inspect query {last} 'SELECT iteration, strategy" in summary
