"""Warm start (synthetic tasks): SFT of the tiny policy on scripted demonstrations."""

from kfp import dsl
from kfp.dsl import Artifact, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def warmstart(
    config_json: str,
    policy: Output[Model],
    predictor: Output[Model],
    optimizer: Output[Artifact],
    metrics: Output[Metrics],
) -> None:
    """The starting policy (HF checkpoint, as the artifact: the tiny policy's few MB, or with
    ``warmstart_init`` the fine-tuned base model), the predictor before its first fit, an empty
    optimizer state."""
    from pathlib import Path

    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.start import warmstart_step

    config = PipelineConfig.from_json(config_json)
    result = warmstart_step(config, Path(policy.path), Path(predictor.path), Path(optimizer.path))
    for key, value in result.items():
        metrics.log_metric(key, value)
    policy.metadata.update({"framework": "transformers", "iteration": 0})
