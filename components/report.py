"""Report: an HTML view of the last iteration's trees and a Markdown summary of the run."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def report(
    config_json: str,
    trees: Input[Dataset],
    state: Input[Artifact],
    start_eval: str,
    final_eval: str,
    tree_view: Output[HTML],
    summary: Output[Markdown],
) -> None:
    """Both render in the KFP run view: the tree view (turns, rewards, V, targets) and the
    accuracy, per-iteration ratios and the trees' Parquet head."""
    import json
    from pathlib import Path

    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.finish import report_step

    report_step(
        PipelineConfig.from_json(config_json),
        Path(trees.path),
        Path(state.path),
        json.loads(start_eval),
        json.loads(final_eval),
        Path(tree_view.path),
        Path(summary.path),
    )
