"""Rollout: grow one iteration's budgeted trees with the policy (here, or as a Ray job)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def rollout(
    config_json: str,
    iteration: int,
    start_iteration: int,
    prompts: Input[Dataset],
    policy: Input[Model],
    predictor: Input[Model],
    trees: Output[Dataset],
    metrics: Output[Metrics],
) -> None:
    """Trees Parquet of iteration start_iteration + iteration; effective ratios, mixed groups,
    units and tokens as metrics. With a Ray dashboard address it runs as a Ray job."""
    from trace_core.train.contract import PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step

    config = PipelineConfig.from_json(config_json)
    call = StepCall(
        "rollout",
        start_iteration + iteration,
        {"prompts": prompts.path, "policy": policy.path, "predictor": predictor.path},
        {"trees": trees.path},
        input_uris={"prompts": prompts.uri, "policy": policy.uri, "predictor": predictor.uri},
    )
    result = run_step(call, config)
    for key, value in result.items():
        metrics.log_metric(key, value)
    trees.metadata.update({"iteration": call.iteration, "format": "trace.trees.parquet"})
