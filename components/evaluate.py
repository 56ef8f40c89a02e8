"""Evaluate: held-out accuracy of a policy (and, for the final one, register the checkpoint)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def evaluate(
    config_json: str,
    prompts: Input[Dataset],
    policy: Input[Model],
    metrics: Output[Metrics],
    predictor: Input[Model] = None,
    optimizer: Input[Artifact] = None,
) -> str:
    """pass@1 (greedy) and mean@k on the eval prompts; returns the report as JSON. Given the
    predictor and a run name, registers policy + predictor (+ the optimizer state) as the
    run's latest checkpoint."""
    import json
    from pathlib import Path

    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.finish import evaluate_step

    config = PipelineConfig.from_json(config_json)
    result = evaluate_step(
        config,
        Path(prompts.path),
        Path(policy.path),
        Path(predictor.path) if predictor else None,
        optimizer_dir=Path(optimizer.path) if optimizer else None,
    )
    metrics.log_metric("accuracy_pass1", result["pass1"]["all"])
    if result["mean_k"]:
        metrics.log_metric(f"accuracy_mean_at_{result['k']}", result["mean_k"]["all"])
    metrics.log_metric("action_parse_rate", result["parse_rate"])
    metrics.log_metric("eval_tokens", result["tokens"])
    metrics.log_metric("iteration", result["iteration"])
    return json.dumps(result)
