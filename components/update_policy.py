"""Update the policy on one iteration's trees (here, or as a Ray job)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def update_policy(
    config_json: str,
    iteration: int,
    start_iteration: int,
    trees: Input[Dataset],
    policy: Input[Model],
    reference: Input[Model],
    new_policy: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """The updated policy (HF checkpoint + optimizer state + log); loss, KL, clip fraction.
    ``reference`` is the starting policy (the KL anchor when kl_coef > 0)."""
    from trace_core.train.contract import PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step

    config = PipelineConfig.from_json(config_json)
    call = StepCall(
        "update",
        start_iteration + iteration,
        {"trees": trees.path, "policy": policy.path, "reference": reference.path},
        {"policy": new_policy.path},
        input_uris={"trees": trees.uri, "policy": policy.uri, "reference": reference.uri},
    )
    result = run_step(call, config)
    for key, value in result.items():
        metrics.log_metric(key, value)
    new_policy.metadata.update({"framework": "transformers", "iteration": call.iteration})
