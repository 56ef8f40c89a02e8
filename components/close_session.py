"""Close session: stop the run's actors; the last iteration's evaluation."""

from kfp import dsl
from kfp.dsl import Metrics, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def close_session(
    config_json: str,
    start_iteration: int,
    metrics: Output[Metrics],
) -> str:
    """Stops the run's trainer and engine actors; returns the last iteration's held-out
    evaluation as JSON, with the registry checkpoint that holds it (a named run). The state
    after the last iteration is read from the store (``trace_core.train.steps.handoff``)."""
    import tempfile
    from pathlib import Path

    from trace_core.rollout.ray_auth import step_errors
    from trace_core.train.contract import EVAL_FILE, PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step
    from trace_core.train.steps.handoff import last_iteration, state_uri

    config = PipelineConfig.from_json(config_json)
    state = state_uri(config, last_iteration(config, start_iteration))
    with tempfile.TemporaryDirectory(prefix="trace-close-") as scratch:
        call = StepCall(
            "close-session",
            0,
            {"state": state},
            {"result": str(Path(scratch, "result"))},
            input_uris={"state": state},
        )
        with step_errors():
            for key, value in run_step(call, config).items():
                metrics.log_metric(key, value)
        return Path(scratch, "result", EVAL_FILE).read_text()
