"""The step that ends a run: report (an HTML view of every iteration's trees and a Markdown
summary that says how to open them), and the figures of an evaluation as a step's metrics.

    record_trees(Path("state-2"), Path("state-3"), 3, trees_uri)   # by each iteration's step
    report_step(config, Path("trees-4"), Path("state-4"), start_eval, final_eval, html, md)

Where each iteration's trees are (a KFP artifact URI: ``s3://``, ``minio://`` or a local path
under ``kfp.local``) travels in the run's state folder (``TREE_URIS``), one iteration's step
to the next, so the report reads them all back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, success_counts
from trace_core.train.contract import TREES, PipelineConfig
from trace_core.train.record import IterationRecord, read_log
from trace_core.train.steps.tracked import end_tracking


def eval_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The figures of an evaluation the pipeline logs as the step's metrics."""
    metrics = {"accuracy_pass1": float(result["pass1"]["all"])}
    if result["mean_k"]:
        metrics[f"accuracy_mean_at_{result['k']}"] = float(result["mean_k"]["all"])
    metrics["action_parse_rate"] = float(result["parse_rate"])
    metrics["eval_tokens"] = float(result["tokens"])
    metrics["iteration"] = float(result["iteration"])
    return metrics


TREE_URIS = "tree_uris.json"
"""In a state folder: ``{"iteration": "URI of its trees folder", ...}``."""


def record_trees(state_in: Path | str, state_out: Path, iteration: int, uri: str) -> None:
    """Write into ``state_out`` where the run's trees are: ``state_in``'s list (a folder, or
    a state's URI in the store) and this iteration's ``uri``."""
    known = read_tree_uris(state_in)
    known[iteration] = uri
    body = {str(i): where for i, where in sorted(known.items())}
    (state_out / TREE_URIS).write_text(json.dumps(body, indent=2) + "\n")


def read_tree_uris(state: Path | str) -> dict[int, str]:
    """The iterations' tree locations a state folder (or a state's URI in the store) holds
    (none for a run's first state)."""
    from trace_core.store.artifacts import open_store

    store = open_store(state)
    path = store.uri(TREE_URIS)
    if not store.exists(TREE_URIS):
        return {}
    try:
        body = json.loads(store.get_bytes(TREE_URIS))
        return {int(i): str(uri) for i, uri in body.items()}
    except (ValueError, AttributeError) as err:
        raise ValueError(f"{path}: not a map of iteration to trees URI ({err})") from None


def report_step(
    config: PipelineConfig,
    trees_dir: Path,
    state_dir: Path,
    start_eval: Mapping[str, object],
    final_eval: Mapping[str, object],
    html_path: Path,
    markdown_path: Path,
    sample: int = 6,
) -> None:
    """The run at a glance: an HTML view of the ``sample`` most mixed trees of every iteration
    whose trees the state lists (the last one's from ``trees_dir``), and a Markdown summary
    (accuracy before and after, one line per iteration, where the trees are and the commands
    that open them, the head of the last trees' Parquet)."""
    from trace_core.store.html import render_html
    from trace_core.store.schema import read_trees
    from trace_core.train.report import summary_markdown

    last = read_trees(trees_dir / TREES)
    iteration = last[0].info.iteration if last else 0
    recorded = read_tree_uris(state_dir)
    where = {i: uri for i, uri in recorded.items() if i != iteration}
    shown, unread = [], {}
    for i, uri in sorted(where.items()):
        try:
            shown += most_mixed(read_tree_uri(uri), sample)
        except (OSError, ValueError) as err:  # a removed artifact: the report says so
            unread[i] = str(err)  # names the URI
    shown += most_mixed(last, sample)
    first = min(where, default=iteration)
    span = f"iteration {iteration}" if first == iteration else f"iterations {first}–{iteration}"
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(
        render_html(shown, title=f"{config.run_id}: {span}, the {sample} most mixed trees of each")
    )
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(
        summary_markdown(
            title=f"TRACE run {config.run_id}",
            settings={
                "task": config.train.task,
                "strategy": config.train.strategy,
                "M (roots)": config.train.budget,
                "N (continuations)": config.train.continuations,
                "iterations": config.train.iterations,
                "seed": config.train.seed,
            },
            records=read_log(state_dir),
            start_eval=start_eval,
            final_eval=final_eval,
            trees_path=trees_dir / TREES,
            tree_uris=recorded,
            unread=unread,
            shown=[t.info.tree_id for t in most_mixed(last, 3)],
        )
    )
    files = {"report.html": html_path, "summary.md": markdown_path}
    end_tracking(config, state_dir, read_log(state_dir), files)  # with MLflow: as artifacts


def read_tree_uri(uri: str) -> list[RolloutTree]:
    """Every tree in the folder or prefix at ``uri``."""
    from trace_core.store.schema import from_table
    from trace_core.store.treeset import open_trees

    return from_table(open_trees(uri).read())


def most_mixed(trees: list[RolloutTree], count: int) -> list[RolloutTree]:
    """The ``count`` trees whose leaves hold both outcomes most evenly, in that order."""
    return sorted(trees, key=lambda t: -mixedness(t))[:count]


def mixedness(tree: RolloutTree) -> float:
    """The share of the minority outcome among the tree's leaves (0.5: half won)."""
    leaves = float(leaf_counts(tree)[ROOT])
    wins = float(success_counts(tree)[ROOT])
    return min(wins, leaves - wins) / leaves if leaves else 0.0


def record_metrics(record: IterationRecord) -> dict[str, float]:
    """An iteration's figures as the step's KFP metrics (flat name → number)."""
    metrics = {"iteration": float(record.iteration), "tokens": float(record.tokens)}
    metrics |= {k: float(v) for k, v in record.rollout.items() if isinstance(v, int | float)}
    metrics |= {
        f"update_{k}": float(v) for k, v in record.update.items() if isinstance(v, int | float)
    }
    metrics |= {f"seconds_{k}": float(v) for k, v in record.seconds.items()}
    metrics["staleness"] = float(record.staleness)
    metrics |= {f"{part}_idle_seconds": float(v) for part, v in record.idle.items()}
    if record.eval:
        metrics |= eval_metrics({**record.eval, "iteration": record.iteration})
    return metrics
