"""Iterate: one training iteration on the run's session (the pipeline runs it once per
iteration, in order)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def iterate(
    config_json: str,
    iteration: int,
    prompts: Input[Dataset],
    trees: Output[Dataset],
    metrics: Output[Metrics],
) -> None:
    """Iteration ``iteration``: rollout on the engine actors, predictor fit ∥ update on the
    trainers, weights to the engines by broadcast, a checkpoint every checkpoint_every
    iterations (written by the trainers into the registry), evaluation every eval_every. It
    reads the state after the iteration before from the store and publishes its own there
    (``trace_core.train.steps.handoff``); the trees Parquet out (the state lists where, for
    the report), the iteration's figures and the S3 bytes it moved as metrics. Run again after
    it committed (a retried pod), it hands on what it wrote then."""
    from trace_core.rollout.ray_auth import step_errors
    from trace_core.train.contract import PipelineConfig
    from trace_core.train.dispatch import iterate_on_store

    config = PipelineConfig.from_json(config_json)
    with step_errors():
        for key, value in iterate_on_store(config, iteration, prompts, trees).items():
            metrics.log_metric(key, value)
    trees.metadata.update({"iteration": iteration, "format": "trace.trees.parquet"})
