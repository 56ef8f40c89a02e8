"""Open session: the run's trainer and engine actors on the Ray cluster, and iteration 0."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def open_session(
    config_json: str,
    start_iteration: int,
    prompts: Input[Dataset],
    policy: Input[Model],
    predictor: Input[Model],
    optimizer: Input[Artifact],
    state: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """The trainers load the starting policy and optimizer state and keep them; the engine
    actors boot from it; a new run's starting policy is evaluated (iteration 0 of the log).
    Where load's artifacts hold references, the actors read the weights where those name
    (``train.dispatch.start_point``); with ``ray_jobs_url`` this pod only submits the job.
    Returns that evaluation as JSON; ``state`` (what the iterations start from) is published
    in the store too, where the first iteration reads it (``train.steps.handoff``)."""
    from pathlib import Path

    from trace_core.rollout.ray_auth import step_errors
    from trace_core.train.contract import EVAL_FILE, PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step
    from trace_core.train.steps.handoff import publish, state_uri

    config = PipelineConfig.from_json(config_json)
    inputs = {"prompts": prompts, "policy": policy, "predictor": predictor, "optimizer": optimizer}
    call = StepCall(
        "open-session",
        start_iteration,
        {name: artifact.path for name, artifact in inputs.items()},
        {"state": state.path},
        input_uris={name: artifact.uri for name, artifact in inputs.items()},
    )
    with step_errors():
        for key, value in run_step(call, config).items():
            metrics.log_metric(key, value)
    # A retried open-session publishes the same session's start again.
    publish(Path(state.path), state_uri(config, start_iteration), replace=True)
    state.metadata.update({"format": "trace.run-state", "iteration": start_iteration})
    return Path(state.path, EVAL_FILE).read_text()
