"""Load where the run starts, as references: the run's latest registry checkpoint (resume) or
the base model. No weights pass through this step's pod or its artifacts."""

from kfp import dsl
from kfp.dsl import Artifact, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def load(
    config_json: str,
    policy: Output[Model],
    predictor: Output[Model],
    optimizer: Output[Artifact],
    metrics: Output[Metrics],
) -> None:
    """Policy: ``reference.json`` naming the base model or the checkpoint's policy/;
    optimizer: ``optimizer.json`` and, resuming, the reference to the checkpoint's optimizer
    state; predictor: the fresh one, or the checkpoint's (a few MB)."""
    from pathlib import Path

    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.start import load_step

    config = PipelineConfig.from_json(config_json)
    result = load_step(config, Path(policy.path), Path(predictor.path), Path(optimizer.path))
    for key, value in result.items():
        metrics.log_metric(key, value)
    policy.metadata.update(
        {"format": "trace.reference", "iteration": int(result["resumed_iteration"])}
    )
