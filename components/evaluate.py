"""Evaluate: held-out accuracy of a policy (and, for the final one, register the checkpoint)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def evaluate(
    config_json: str,
    prompts: Input[Dataset],
    policy: Input[Model],
    metrics: Output[Metrics],
    predictor: Input[Model] = None,
    optimizer: Input[Artifact] = None,
) -> str:
    """pass@1 (greedy) and mean@k on the eval prompts, on the run's engine (with a Ray dashboard
    address, as a Ray job on its engine actors); returns the report as JSON. Given the
    predictor and a run name, registers policy + predictor (+ the optimizer state) as the
    run's latest checkpoint."""
    import tempfile
    from pathlib import Path

    from trace_core.train.contract import EVAL_FILE, PipelineConfig, StepCall
    from trace_core.train.dispatch import run_step

    config = PipelineConfig.from_json(config_json)
    inputs = {"prompts": prompts, "policy": policy, "predictor": predictor, "optimizer": optimizer}
    given = {name: artifact for name, artifact in inputs.items() if artifact}
    with tempfile.TemporaryDirectory(prefix="trace-evaluate-") as scratch:
        call = StepCall(
            "evaluate",
            0,
            {name: artifact.path for name, artifact in given.items()},
            {"result": str(Path(scratch, "result"))},
            input_uris={name: artifact.uri for name, artifact in given.items()},
        )
        for key, value in run_step(call, config).items():
            metrics.log_metric(key, value)
        return Path(scratch, "result", EVAL_FILE).read_text()
