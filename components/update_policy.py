"""Update the policy on one iteration's trees (here, or as a Ray job)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def update_policy(
    config_json: str,
    iteration: int,
    start_iteration: int,
    trees: Input[Dataset],
    policy: Input[Model],
    reference: Input[Model],
    optimizer: Input[Artifact],
    new_policy: Output[Model],
    new_optimizer: Output[Artifact],
    metrics: Output[Metrics],
) -> None:
    """The updated policy (HF checkpoint + log) and optimizer state; loss, KL, clip fraction.
    ``reference`` is the starting policy (the KL anchor, read only when kl_coef > 0); the
    optimizer state travels only between update steps, never to rollout or evaluation."""
    from trace_core.train.contract import PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step

    config = PipelineConfig.from_json(config_json)
    inputs = {"trees": trees, "policy": policy, "reference": reference, "optimizer": optimizer}
    call = StepCall(
        "update",
        start_iteration + iteration,
        {name: artifact.path for name, artifact in inputs.items()},
        {"policy": new_policy.path, "optimizer": new_optimizer.path},
        input_uris={name: artifact.uri for name, artifact in inputs.items()},
    )
    result = run_step(call, config)
    for key, value in result.items():
        metrics.log_metric(key, value)
    new_policy.metadata.update({"framework": "transformers", "iteration": call.iteration})
