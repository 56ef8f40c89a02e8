"""What ``trace-rl inspect summary`` and ``show`` compute: a tree set's summary, one tree as text.

    source = open_trees("build/rollout")                      # or s3://bucket/prefix, a file
    console.print(summary_table(summarize(source)))           # trees, strategies, ratios, cost
    console.print(render_tree(find_trees(source, [7])[0]))    # turns, rewards, V, targets

``summarize`` reads only what ``algo.metrics.measure`` needs (tree keys, parents, branch flags,
rewards and the generated token ids, whose lengths are the token cost); the other per-node
columns are filled with empty placeholders before the trees are rebuilt. The effective ratios
treat every tree in the source as one batch, whatever its run or iteration.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from trace_core.algo.metrics import BatchMetrics, measure
from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, recursive_targets, success_counts
from trace_core.store.schema import TREE_SCHEMA, from_table
from trace_core.store.treeset import TreeSource

# What measure() reads; everything else is a placeholder in the rebuilt trees.
METRIC_COLUMNS = (
    "run_id",
    "iteration",
    "prompt_id",
    "tree_id",
    "strategy",
    "policy_version",
    "node_id",
    "parent_id",
    "branch",
    "reward",
    "gen_token_ids",
)


@dataclass(frozen=True)
class GroupSummary:
    """The trees of one strategy (or all of them): counts, reward mix and ``measure``."""

    trees: int
    nodes: int
    leaves: int
    successes: int  # leaves with reward 1
    prompts_all_success: int  # trees with rollouts whose leaves are all 1
    prompts_all_failure: int
    prompts_mixed: int
    metrics: BatchMetrics

    def to_json(self) -> dict[str, float]:
        counts = {k: float(v) for k, v in vars(self).items() if k != "metrics"}
        return {**counts, **self.metrics.as_dict()}


@dataclass(frozen=True)
class TreeSetSummary:
    uri: str
    files: int
    runs: tuple[str, ...]
    iterations: tuple[int, ...]
    strategies: dict[str, GroupSummary]
    total: GroupSummary
    staleness: dict[int, int] = dataclasses.field(default_factory=dict)
    """Per iteration, how many versions older than the weights it updated its trees' policy
    was at most (``iteration - 1 - policy_version``; 0 for a synchronous run)."""

    def to_json(self) -> dict[str, object]:
        return {
            "uri": self.uri,
            "files": self.files,
            "runs": list(self.runs),
            "iterations": list(self.iterations),
            "staleness": {str(i): s for i, s in sorted(self.staleness.items())},
            "strategies": {k: v.to_json() for k, v in self.strategies.items()},
            "total": self.total.to_json(),
        }


def metric_trees(table: pa.Table) -> list[RolloutTree]:
    """Trees from a table holding ``METRIC_COLUMNS``; text, observations and logprobs empty."""
    n = table.num_rows
    gen = table.column("gen_token_ids").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(gen), 0).to_numpy().astype(np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    empty_offsets = pa.array(np.zeros(n + 1, np.int32))
    filled = {
        "depth": pa.array(np.zeros(n, np.int16)),
        "is_leaf": pa.array(np.zeros(n, np.bool_)),
        "truncated": pa.array(np.zeros(n, np.bool_)),
        "obs_token_ids": pa.ListArray.from_arrays(empty_offsets, pa.array([], pa.int32())),
        "logprobs": pa.ListArray.from_arrays(
            offsets, pa.array(np.zeros(int(lengths.sum()), np.float32))
        ),
        "text": pa.repeat(pa.scalar("", pa.string()), n),
        "observation": pa.repeat(pa.scalar("", pa.string()), n),
        "predicted_v": pa.nulls(n, pa.float64()),
        "target_v": pa.nulls(n, pa.float64()),
    }
    columns = [
        filled[f.name] if f.name in filled else table.column(f.name).combine_chunks()
        for f in TREE_SCHEMA
    ]
    return from_table(pa.Table.from_arrays(columns, schema=TREE_SCHEMA))


def summarize_trees(trees: Sequence[RolloutTree]) -> GroupSummary:
    leaves = successes = all_success = all_failure = mixed = 0
    for tree in trees:
        n, s = int(leaf_counts(tree)[ROOT]), int(success_counts(tree)[ROOT])
        leaves += n
        successes += s
        if tree.root_rollouts:
            all_success += s == n
            all_failure += s == 0
            mixed += 0 < s < n
    return GroupSummary(
        trees=len(trees),
        nodes=sum(t.size for t in trees),
        leaves=leaves,
        successes=successes,
        prompts_all_success=all_success,
        prompts_all_failure=all_failure,
        prompts_mixed=mixed,
        metrics=measure(trees),
    )


def summarize(
    source: TreeSource, progress: Callable[[int, int], None] | None = None
) -> TreeSetSummary:
    """Summary of every tree in ``source``; ``progress(files done, files)`` after each file."""
    by_strategy: dict[str, list[RolloutTree]] = defaultdict(list)
    runs: Counter[str] = Counter()
    iterations: set[int] = set()
    staleness: dict[int, int] = {}
    for i, key in enumerate(source.keys):
        part = dataclasses.replace(source, keys=(key,))
        for tree in metric_trees(part.read(METRIC_COLUMNS)):
            info = tree.info
            by_strategy[info.strategy].append(tree)
            runs[info.run_id] += 1
            iterations.add(info.iteration)
            stale = info.iteration - 1 - info.policy_version
            staleness[info.iteration] = max(staleness.get(info.iteration, 0), stale)
        if progress:
            progress(i + 1, len(source.keys))
    every = [t for trees in by_strategy.values() for t in trees]
    return TreeSetSummary(
        uri=source.uri,
        files=len(source.keys),
        runs=tuple(sorted(runs)),
        iterations=tuple(sorted(iterations)),
        strategies={name: summarize_trees(by_strategy[name]) for name in sorted(by_strategy)},
        total=summarize_trees(every),
        staleness=staleness,
    )


def _staleness_text(staleness: dict[int, int]) -> str:
    """ "; staleness 0..1 (trees on older weights: iterations 3, 4)", or "" when none was."""
    stale = sorted(i for i, s in staleness.items() if s > 0)
    if not stale:
        return ""
    values = sorted(set(staleness.values()))
    shown = ", ".join(map(str, stale[:8])) + (", ..." if len(stale) > 8 else "")
    return f"; staleness {values[0]}..{values[-1]} (trees on older weights: iterations {shown})"


def summary_table(summary: TreeSetSummary) -> Table:
    iterations = summary.iterations
    span = (
        f"{iterations[0]}..{iterations[-1]} ({len(iterations)})"
        if len(iterations) > 1
        else ", ".join(map(str, iterations))
    )
    # Text, not markup: run ids, strategies and the URI are printed as they are.
    table = Table(
        title=Text(
            f"{summary.uri}: {summary.total.trees:,} trees, {summary.total.nodes:,} nodes in "
            f"{summary.files} file(s); runs {', '.join(summary.runs)}; iterations {span}"
            f"{_staleness_text(summary.staleness)}"
        ),
        caption="prompt mix: trees whose leaves are all 0 / mixed / all 1. prompt eff.: share "
        "of prompts whose leaves hold both rewards (the paper's effective ratio). anchor eff.: "
        "the same over anchors, the sibling groups a tree branches into (a root with ≥ 2 "
        "rollouts, each expanded prefix). mixed/100u: anchors with both rewards per 100 units. "
        "units: the rollout budget spent, 1 per root rollout and 0.5 per continuation.",
    )
    heads = (
        "strategy",
        "trees",
        "nodes",
        "leaves",
        "reward 1",
        "prompt mix 0/mixed/1",
        "prompt eff.",
        "anchor eff.",
        "mixed/100u",
        "continuations",
        "units",
        "tokens",
    )
    for head in heads:
        table.add_column(head, justify="left" if head == "strategy" else "right")
    rows = list(summary.strategies.items())
    if len(rows) > 1:
        rows.append(("all", summary.total))
    for name, g in rows:
        m = g.metrics
        share = g.successes / g.leaves if g.leaves else 0.0
        table.add_row(
            Text(name or "(none)"),
            f"{g.trees:,}",
            f"{g.nodes:,}",
            f"{g.leaves:,}",
            f"{share:.1%}",
            f"{g.prompts_all_failure}/{g.prompts_mixed}/{g.prompts_all_success}",
            f"{m.prompt_effective_ratio:.3f}",
            f"{m.anchor_effective_ratio:.3f}",
            f"{m.mixed_per_100_units:.2f}",
            f"{m.continuations:,}",
            f"{m.units:,.0f}" if float(m.units).is_integer() else f"{m.units:,.1f}",
            f"{m.tokens:,}",
        )
    return table


# --- one tree ----------------------------------------------------------------------------------
class TreeNotFound(LookupError):
    """No tree, or more than one, matches the requested id; the message says which."""


def find_trees(
    source: TreeSource,
    tree_ids: Sequence[int],
    *,
    run: str | None = None,
    iteration: int | None = None,
) -> list[RolloutTree]:
    """The trees with ``tree_ids`` (in that order), reading only their row groups' rows.

    tree_id is unique within (run, iteration); when a source holds several, ``run`` and
    ``iteration`` pick one and an ambiguous id is an error listing the candidates.
    """
    where = ds.field("tree_id").isin(list(tree_ids))
    if run is not None:
        where &= ds.field("run_id") == run
    if iteration is not None:
        where &= ds.field("iteration") == iteration
    found: dict[int, list[RolloutTree]] = defaultdict(list)
    for tree in from_table(source.read(filter=where)):
        found[tree.info.tree_id].append(tree)
    scope = "".join(
        f", {name} {value!r}" for name, value in (("run", run), ("iteration", iteration)) if value
    )
    trees = []
    for tree_id in tree_ids:
        matches = found.get(tree_id, [])
        if not matches:
            raise TreeNotFound(f"{source.uri}: no tree with tree_id {tree_id}{scope}")
        if len(matches) > 1:
            where_found = ", ".join(
                f"(run {t.info.run_id!r}, iteration {t.info.iteration})" for t in matches[:10]
            )
            raise TreeNotFound(
                f"{source.uri}: tree_id {tree_id} is in {len(matches)} trees: {where_found}; "
                "pick one with --run and --iteration"
            )
        trees.append(matches[0])
    return trees


def sample_trees(source: TreeSource, count: int) -> list[RolloutTree]:
    """The first ``count`` trees of the source, in file order."""
    keys = source.read(["run_id", "iteration", "tree_id"])
    seen: dict[tuple[str, int, int], None] = {}
    for row in zip(*(keys.column(c).to_pylist() for c in keys.column_names), strict=True):
        seen.setdefault(row)
        if len(seen) == count:
            break
    trees = []
    for run, iteration, tree_id in seen:
        trees += find_trees(source, [tree_id], run=run, iteration=iteration)
    return trees


def _number(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}"


def _clip(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if width <= 0 or len(flat) <= width else flat[: width - 1] + "…"


def node_label(
    tree: RolloutTree, node: int, width: int, targets: np.ndarray, leaves: np.ndarray
) -> Text:
    """One line: id, continuation mark, text → observation, reward, V, V̂, leaves below."""
    label = Text()
    label.append(f"#{node} ", style="dim")
    if node == ROOT:
        label.append("prompt ", style="bold")
        label.append(_clip(tree.text[node], width))
    else:
        if tree.branch[node]:
            label.append("↳ continuation ", style="bold yellow")
        label.append(_clip(tree.text[node], width), style="cyan")
        if tree.observation[node]:
            label.append(" → ", style="dim")
            label.append(_clip(tree.observation[node], width), style="magenta")
    reward = tree.reward[node]
    if not math.isnan(reward):
        label.append(f"  r={reward:g}", style="bold green" if reward == 1 else "bold red")
    label.append(f"  V={_number(tree.predicted_v[node])}", style="blue")
    label.append(f"  V̂={_number(targets[node])}", style="bold")
    if leaves[node] > 1:
        label.append(f"  n={leaves[node]}", style="dim")
    return label


def render_tree(tree: RolloutTree, width: int = 80) -> Tree:
    """The tree for a terminal: every turn with its reward, predicted V and target V̂."""
    info = tree.info
    title = Text()
    title.append(f"tree {info.tree_id}", style="bold")
    title.append(
        f" · prompt {info.prompt_id} · run {info.run_id} · iteration {info.iteration} · "
        f"{info.strategy or '(no strategy)'} · policy v{info.policy_version} · "
        f"{tree.size} nodes, {tree.root_rollouts} rollouts + {tree.continuations} continuations "
        f"= {tree.units:g} units, {tree.generated_tokens:,} tokens",
        style="dim",
    )
    root = Tree(title)
    targets, leaves = recursive_targets(tree), leaf_counts(tree)
    branches = {ROOT: root.add(node_label(tree, ROOT, width, targets, leaves))}
    for node in range(1, tree.size):  # parents come before children
        parent = int(tree.parent[node])
        branches[node] = branches[parent].add(node_label(tree, node, width, targets, leaves))
    return root
