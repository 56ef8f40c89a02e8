"""Report: an HTML view of the run's trees and a Markdown summary of the run."""

from kfp import dsl
from kfp.dsl import HTML, Markdown, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def report(
    config_json: str,
    start_iteration: int,
    start_eval: str,
    final_eval: str,
    tree_view: Output[HTML],
    summary: Output[Markdown],
) -> None:
    """Both render in the KFP run view: the tree view (turns, rewards, V, targets) and the
    accuracy, per-iteration ratios and the last trees' Parquet head. The state after the last
    iteration, read from the store, lists where every iteration's trees are."""
    import json
    import tempfile
    from pathlib import Path

    from trace_core.store.sync import download_folder
    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.finish import read_tree_uris, report_step
    from trace_core.train.steps.handoff import fetch, last_iteration, state_uri

    config = PipelineConfig.from_json(config_json)
    last = last_iteration(config, start_iteration)
    with tempfile.TemporaryDirectory(prefix="trace-report-") as scratch:
        state = fetch(state_uri(config, last), Path(scratch, "state"))
        trees = Path(scratch, "trees")
        download_folder(read_tree_uris(state)[last], trees)
        report_step(
            config,
            trees,
            state,
            json.loads(start_eval),
            json.loads(final_eval),
            Path(tree_view.path),
            Path(summary.path),
        )
