"""The steps that end a run: evaluate (held-out accuracy; the final one registers the run's
checkpoint) and report (an HTML view of the last trees and a Markdown summary).

    evaluate_step(config, Path("prompts"), Path("policy-4"), Path("predictor-4"))
    report_step(config, Path("trees-4"), Path("policy-4"), start_eval, final_eval, html, md)
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, success_counts
from trace_core.envs.base import TaskSuite
from trace_core.train.contract import PROMPTS_EVAL, TREES, PipelineConfig
from trace_core.train.record import IterationRecord, read_log
from trace_core.train.steps.start import BASE_MODEL, open_registry


def evaluate_step(
    config: PipelineConfig,
    prompts_dir: Path,
    policy_dir: Path,
    predictor_dir: Path | None = None,
    suite: TaskSuite | None = None,
    optimizer_dir: Path | None = None,
    engine_checkpoint: str | None = None,
) -> dict[str, object]:
    """Held-out pass@1 and mean@k of the policy on the eval prompts, on the run's engine (in
    this process, or its engine actors). With ``predictor_dir`` (the final evaluation) and a run
    name, the policy and predictor are then registered as the run's latest checkpoint, which
    the next run of that name resumes from, and the run's kept engine actors are stopped.
    ``engine_checkpoint``: where the engine actors load
    the policy from (its ``s3://`` URI), when ``policy_dir`` holds only its tokenizer and
    config."""
    from trace_core.envs.prompts import read_prompts
    from trace_core.envs.suites import make_suite
    from trace_core.policy.checkpoint import load_tokenizer
    from trace_core.train.iteration import evaluate, turn_format
    from trace_core.train.progress import LineProgress
    from trace_core.train.steps.cycle import worker_address

    train = config.train
    task, tasks = read_prompts(str(prompts_dir / PROMPTS_EVAL))
    suite = suite or make_suite(task, train.data, train.seed)
    fmt = turn_format(train, suite, load_tokenizer(policy_dir))
    bar = LineProgress("evaluate", len(tasks), "tasks")
    report = evaluate(
        engine_checkpoint or policy_dir, fmt, suite.make_env, tasks, train,
        address=worker_address(config), stage=bar.note, engine_name=config.engine_name,
    )  # fmt: skip
    if predictor_dir is not None and config.engine_name:  # the run's last use of its engines
        from trace_core.rollout.ray_pool import release_engines

        release_engines(config.engine_name, worker_address(config))
    history = read_log(policy_dir)
    result: dict[str, object] = {
        **report.as_dict(),
        "tokens": report.tokens,
        "iteration": history[-1].iteration if history else 0,
    }
    if predictor_dir is not None and config.run_name:
        result["checkpoint"] = register_checkpoint(
            config, policy_dir, predictor_dir, history, optimizer_dir
        )
    return result


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
    policy_dir: Path,
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
            records=read_log(policy_dir),
            start_eval=start_eval,
            final_eval=final_eval,
            trees_path=trees_dir / TREES,
        )
    )


def register_checkpoint(
    config: PipelineConfig,
    policy_dir: Path,
    predictor_dir: Path,
    history: list[IterationRecord],
    optimizer_dir: Path | None = None,
) -> str:
    """Save policy/, predictor/ (and optimizer/, so that a resumed run keeps AdamW's
    moments) as the run's latest checkpoint; returns its folder URI."""
    iteration = history[-1].iteration if history else 0
    folders = [("policy", policy_dir), ("predictor", predictor_dir)]
    if optimizer_dir is not None:
        folders.append(("optimizer", optimizer_dir))
    with tempfile.TemporaryDirectory(prefix="trace-checkpoint-") as scratch:
        for name, source in folders:
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                link = Path(scratch, name, path.relative_to(source))
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path.resolve())
        registry = open_registry(config)
        checkpoint = registry.save(
            config.run_name,
            iteration,
            scratch,
            metadata={
                "strategy": config.train.strategy,
                BASE_MODEL: str(config.train.init or ""),
            },
        )
    return registry.store.uri(checkpoint.key)


def mixedness(tree: RolloutTree) -> float:
    """The share of the minority outcome among the tree's leaves (0.5: half won)."""
    leaves = float(leaf_counts(tree)[ROOT])
    wins = float(success_counts(tree)[ROOT])
    return min(wins, leaves - wins) / leaves if leaves else 0.0
