"""Close session: stop the run's actors; the last iteration's evaluation."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def close_session(
    config_json: str,
    state: Input[Artifact],
    metrics: Output[Metrics],
) -> str:
    """Stops the run's trainer and engine actors; returns the last iteration's held-out
    evaluation as JSON, with the registry checkpoint that holds it (a named run)."""
    import tempfile
    from pathlib import Path

    from trace_core.train.contract import EVAL_FILE, PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step

    config = PipelineConfig.from_json(config_json)
    with tempfile.TemporaryDirectory(prefix="trace-close-") as scratch:
        call = StepCall(
            "close-session",
            0,
            {"state": state.path},
            {"result": str(Path(scratch, "result"))},
            input_uris={"state": state.uri},
        )
        for key, value in run_step(call, config).items():
            metrics.log_metric(key, value)
        return Path(scratch, "result", EVAL_FILE).read_text()
