"""Iterate: one training iteration on the run's session."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def iterate(
    config_json: str,
    iteration: int,
    start_iteration: int,
    prompts: Input[Dataset],
    state: Input[Artifact],
    trees: Output[Dataset],
    new_state: Output[Artifact],
    metrics: Output[Metrics],
) -> None:
    """Iteration start_iteration + iteration: rollout on the engine actors, predictor fit ∥
    update on the trainers, weights to the engines by broadcast, a checkpoint every
    checkpoint_every iterations (written by the trainers into the registry), evaluation every
    eval_every. Trees Parquet out (the state lists where, for the report); the iteration's
    figures and the S3 bytes it moved as metrics."""
    from pathlib import Path

    from trace_core.train.contract import PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step
    from trace_core.train.steps.finish import record_trees

    config = PipelineConfig.from_json(config_json)
    call = StepCall(
        "iterate",
        start_iteration + iteration,
        {"prompts": prompts.path, "state": state.path},
        {"trees": trees.path, "state": new_state.path},
        input_uris={"prompts": prompts.uri, "state": state.uri},
    )
    for key, value in run_step(call, config).items():
        metrics.log_metric(key, value)
    # Where this iteration's trees land, beside the earlier ones': the report shows them all.
    record_trees(Path(state.path), Path(new_state.path), call.iteration, trees.uri)
    trees.metadata.update({"iteration": call.iteration, "format": "trace.trees.parquet"})
    new_state.metadata.update({"format": "trace.run-state", "iteration": call.iteration})
