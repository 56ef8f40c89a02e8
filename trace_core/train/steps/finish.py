"""The step that ends a run: report (an HTML view of the last trees and a Markdown summary),
and the figures of an evaluation as a step's metrics.

    report_step(config, Path("trees-4"), Path("state-4"), start_eval, final_eval, html, md)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, success_counts
from trace_core.train.contract import TREES, PipelineConfig
from trace_core.train.record import read_log


def eval_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The figures of an evaluation the pipeline logs as the step's metrics."""
    metrics = {"accuracy_pass1": float(result["pass1"]["all"])}
    if result["mean_k"]:
        metrics[f"accuracy_mean_at_{result['k']}"] = float(result["mean_k"]["all"])
    metrics["action_parse_rate"] = float(result["parse_rate"])
    metrics["eval_tokens"] = float(result["tokens"])
    metrics["iteration"] = float(result["iteration"])
    return metrics


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
    """The run at a glance: an HTML view of a sample of the last trees, and a Markdown summary
    (accuracy before and after, one line per iteration, the head of the trees' Parquet)."""
    from trace_core.store.html import render_html
    from trace_core.store.schema import read_trees
    from trace_core.train.report import summary_markdown

    trees = read_trees(trees_dir / TREES)
    iteration = trees[0].info.iteration if trees else 0
    # The most contrastive trees first: the ones whose leaves hold both outcomes.
    shown = sorted(trees, key=lambda t: -mixedness(t))[:sample]
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(
        render_html(shown, title=f"{config.run_id}: iteration {iteration} rollout trees")
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
        )
    )


def mixedness(tree: RolloutTree) -> float:
    """The share of the minority outcome among the tree's leaves (0.5: half won)."""
    leaves = float(leaf_counts(tree)[ROOT])
    wins = float(success_counts(tree)[ROOT])
    return min(wins, leaves - wins) / leaves if leaves else 0.0
