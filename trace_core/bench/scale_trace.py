"""The request stream of one rollout iteration, read back from its stored trees.

Every turn node of a tree was one request to the engine: its prompt is the exact token
history after its parent (the tree's prompt, then every earlier turn's generated and
observation tokens), and it generated the node's ``gen_token_ids``. A ``TurnStream`` holds,
per turn, those token counts and the order constraints the driver obeyed:

* a turn waits for its parent turn and the env step that followed it (``parent``);
* the first turn of a continuation (``branch``) also waits for every root-rollout turn of its
  own tree (TRACE's stage 2 is prompt-local), or, under a global barrier, of every tree.

What a worker's prefix cache holds depends on where the earlier turns ran, so the cached
part of each prompt is worked out by the simulation (``scale_sim``); ``reusable_tokens``
here is its upper bound: the prompt less the tokens no earlier turn of the tree computed
(the parent's observation; the whole prompt for the first root turn of a tree).

The Parquet schema keeps no timings, so the env step of each turn is timed here by replaying
the tree's actions in the task's own env (``time_env_steps``); envs are deterministic, so the
replay is the episode that was played. The driver's other per-turn work (decoding the action,
tokenising the observation) is a constant of the cost profile (``scale``).

Not recovered: when every root rollout of a prompt ended after one turn, ``grow_trees``
spends its continuation budget on extra root rollouts after stage 1; they are children of the
root like the first roots, so here they start with stage 1.

    trees = read_trees("build/scale/trees.parquet")
    stream = turn_stream(trees)
    stream = time_env_steps(stream, trees, make_suite("calc", None, 0))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from trace_core.algo.tree import ROOT, RolloutTree
from trace_core.envs.base import TaskSuite

IntArray = npt.NDArray[np.int64]
_T = TypeVar("_T", bound=np.generic)


@dataclass(frozen=True)
class TurnStream:
    """One row per turn (request), trees one after another, each tree's turns in node order
    (a parent's turn always comes before its children's)."""

    tree: IntArray
    """Index of the turn's tree in the set."""
    node: IntArray
    """The turn's node id in its tree."""
    parent: IntArray
    """Row of the turn this one continues (-1: a first turn, whose prompt is the tree's)."""
    branch: npt.NDArray[np.bool_]
    """First turn of a continuation: waits for the tree's (or, barrier, every) stage 1."""
    stage: IntArray
    """1: a root rollout's turn; 2: a turn of a continuation."""
    prompt_tokens: IntArray
    generated_tokens: IntArray
    observation_tokens: IntArray
    """Tokens the env's reply appended after this turn (0 after a last turn)."""
    reusable_tokens: IntArray
    """Prompt tokens an earlier turn of the tree computed: the best any cache can hit."""
    env_seconds: npt.NDArray[np.float64]
    """The env step after the turn (0 until ``time_env_steps`` fills it in)."""
    trees: int
    root_prompt_tokens: IntArray
    """(trees,) prompt tokens of each tree's root."""

    @property
    def turns(self) -> int:
        return len(self.tree)

    def children(self) -> list[list[int]]:
        """Rows continuing each row."""
        out: list[list[int]] = [[] for _ in range(self.turns)]
        for row, parent in enumerate(self.parent.tolist()):
            if parent >= 0:
                out[parent].append(row)
        return out

    def summary(self) -> dict[str, float]:
        return {
            "trees": float(self.trees),
            "turns": float(self.turns),
            "stage2_turns": float(np.count_nonzero(self.stage == 2)),
            "prompt_tokens": float(self.prompt_tokens.sum()),
            "generated_tokens": float(self.generated_tokens.sum()),
            "reusable_tokens": float(self.reusable_tokens.sum()),
            "env_seconds": float(self.env_seconds.sum()),
        }


def turn_stream(trees: Sequence[RolloutTree]) -> TurnStream:
    """The requests that grew ``trees`` (see the module docstring)."""
    cols: dict[str, list[int]] = {
        k: []
        for k in ("tree", "node", "parent", "branch", "stage", "prompt", "gen", "obs", "reuse")
    }
    roots = []
    for t, tree in enumerate(trees):
        row_of = {ROOT: -1}
        history = np.zeros(tree.size, dtype=np.int64)  # tokens of the history after each node
        history[ROOT] = len(tree.obs_tokens[ROOT])
        roots.append(int(history[ROOT]))
        stage = np.ones(tree.size, dtype=np.int64)
        first_root_turn = True
        for v in range(1, tree.size):
            p = int(tree.parent[v])
            gen, obs = len(tree.gen_tokens[v]), len(tree.obs_tokens[v])
            history[v] = history[p] + gen + obs
            stage[v] = 2 if tree.branch[v] or (p != ROOT and stage[p] == 2) else 1
            if p == ROOT:
                reuse = 0 if first_root_turn else int(history[ROOT])
                first_root_turn = False
            elif tree.branch[v]:
                reuse = int(history[p])  # the prefix's own next turn read all of it
            else:
                reuse = int(history[p]) - len(tree.obs_tokens[p])
            row_of[v] = len(cols["tree"])
            for key, value in (
                ("tree", t), ("node", v), ("parent", row_of[p]), ("branch", int(tree.branch[v])),
                ("stage", int(stage[v])), ("prompt", int(history[p])), ("gen", gen),
                ("obs", obs), ("reuse", reuse),
            ):  # fmt: skip
                cols[key].append(value)
    arr = {k: np.asarray(v, dtype=np.int64) for k, v in cols.items()}
    return TurnStream(
        tree=arr["tree"],
        node=arr["node"],
        parent=arr["parent"],
        branch=arr["branch"].astype(bool),
        stage=arr["stage"],
        prompt_tokens=arr["prompt"],
        generated_tokens=arr["gen"],
        observation_tokens=arr["obs"],
        reusable_tokens=arr["reuse"],
        env_seconds=np.zeros(len(arr["tree"])),
        trees=len(trees),
        root_prompt_tokens=np.asarray(roots, dtype=np.int64),
    )


def flat_stream(stream: TurnStream) -> TurnStream:
    """Flat GRPO at the same rollout budget: each tree's units (1 per root rollout, 0.5 per
    continuation) spent as whole episodes, copied round-robin from its root rollouts.

    No turn branches, so nothing waits for a stage; copies share only the prompt (their
    first turns are identical prompts, as a GRPO group's are).
    """
    children = stream.children()
    rows: list[int] = []
    parents: list[int] = []
    node: list[int] = []
    for t in range(stream.trees):
        mine = np.flatnonzero(stream.tree == t)
        firsts = [int(r) for r in mine if stream.parent[r] < 0]
        units = len(firsts) + 0.5 * int(np.count_nonzero(stream.branch[mine]))
        chains = []
        for first in firsts:  # each root rollout's turns, first to last
            chain, row = [first], first
            while nexts := [c for c in children[row] if stream.stage[c] == 1]:
                row = nexts[0]
                chain.append(row)
            chains.append(chain)
        for e in range(round(units)):
            previous = -1
            for row in chains[e % len(chains)] if chains else []:
                parents.append(previous)
                previous = len(rows)
                rows.append(row)
                node.append(len(node) + 1)
    take = np.asarray(rows, dtype=np.int64)
    reuse = stream.reusable_tokens[take].copy()
    starts = np.asarray(parents) < 0
    seen: set[int] = set()
    for i in np.flatnonzero(starts):  # the first episode of a prompt reads it afresh
        t = int(stream.tree[take[i]])
        reuse[i] = stream.root_prompt_tokens[t] if t in seen else 0
        seen.add(t)
    return replace(
        stream,
        tree=stream.tree[take],
        node=np.asarray(node, dtype=np.int64),
        parent=np.asarray(parents, dtype=np.int64),
        branch=np.zeros(len(take), dtype=bool),
        stage=np.ones(len(take), dtype=np.int64),
        prompt_tokens=stream.prompt_tokens[take],
        generated_tokens=stream.generated_tokens[take],
        observation_tokens=stream.observation_tokens[take],
        reusable_tokens=reuse,
        env_seconds=stream.env_seconds[take],
    )


def time_env_steps(
    stream: TurnStream, trees: Sequence[RolloutTree], suite: TaskSuite, repeats: int = 5
) -> TurnStream:
    """``stream`` with every turn's env step timed: each root-to-leaf path is replayed in a
    fresh env of ``suite`` (its tasks found by the trees' prompt ids), ``repeats`` times; a
    turn keeps its fastest time. Raises ``LookupError`` naming a prompt
    id the suite does not have."""
    tasks = {task.id: task for split in ("train", "eval") for task in suite.tasks(split)}
    seconds = np.full(stream.turns, np.inf)
    row_of = {
        (int(t), int(n)): r for r, (t, n) in enumerate(zip(stream.tree, stream.node, strict=True))
    }
    found = []
    for t, tree in enumerate(trees):
        task = tasks.get(tree.info.prompt_id)
        if task is None:
            raise LookupError(
                f"tree {t}: prompt id {tree.info.prompt_id!r} is not a task of the suite; "
                "pass the --task the trees were grown on"
            )
        found.append(task)
    # Whole passes, not repeats of one path in a row: a stall of the process (another job
    # on the machine, a CPU quota) then spoils one pass of a turn, not all of them.
    for _ in range(repeats):
        for t, (tree, task) in enumerate(zip(trees, found, strict=True)):
            for leaf in np.flatnonzero(tree.leaf_mask):
                env = suite.make_env()
                env.reset(task)
                for v in tree.path(int(leaf))[1:].tolist():
                    start = time.perf_counter()
                    step = env.step(tree.text[v])
                    took = time.perf_counter() - start
                    row = row_of[(t, v)]
                    seconds[row] = min(seconds[row], took)
                    if step.done:
                        break
    seconds[~np.isfinite(seconds)] = 0.0
    return replace(stream, env_seconds=seconds)


def resize_stream(stream: TurnStream, copies: int = 1, token_scale: float = 1.0) -> TurnStream:
    """``copies`` copies of the iteration's trees (more prompts, same shapes) with every token
    count × ``token_scale`` (longer turns, same tree shapes): a workload for a model or a
    cluster larger than the one that grew the trees."""
    if copies < 1 or not token_scale > 0:
        raise ValueError(f"copies must be >= 1 and token_scale > 0, got {copies}, {token_scale}")
    n = stream.turns

    def tile(a: npt.NDArray[_T]) -> npt.NDArray[_T]:
        return np.tile(a, copies)

    def scaled(a: IntArray, least: int) -> IntArray:
        return np.maximum(np.rint(a * token_scale), least).astype(np.int64)

    offsets = np.repeat(np.arange(copies), n)
    parent = tile(stream.parent)
    parent = np.where(parent >= 0, parent + offsets * n, -1)
    tree = tile(stream.tree) + offsets * stream.trees
    branch = tile(stream.branch)
    roots = scaled(tile(stream.root_prompt_tokens), 1)
    gen, obs = scaled(tile(stream.generated_tokens), 1), scaled(tile(stream.observation_tokens), 0)
    # Prompts follow from the scaled parts, so a child's prompt stays its parent's + turn.
    prompt, reuse = np.zeros(len(tree), np.int64), np.zeros(len(tree), np.int64)
    first_seen = np.zeros(len(roots), dtype=bool)
    for r, p in enumerate(parent.tolist()):
        if p < 0:
            prompt[r] = roots[tree[r]]
            reuse[r] = prompt[r] if first_seen[tree[r]] else 0
            first_seen[tree[r]] = True
        else:
            prompt[r] = prompt[p] + gen[p] + obs[p]
            reuse[r] = prompt[r] if branch[r] else prompt[r] - obs[p]
    return TurnStream(
        tree=tree,
        node=tile(stream.node),
        parent=parent,
        branch=branch,
        stage=tile(stream.stage),
        prompt_tokens=prompt,
        generated_tokens=gen,
        observation_tokens=obs,
        reusable_tokens=reuse,
        env_seconds=tile(stream.env_seconds),
        trees=stream.trees * copies,
        root_prompt_tokens=roots,
    )
