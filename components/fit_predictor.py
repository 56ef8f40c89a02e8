"""Fit the success predictor V(prefix) on one iteration's trees."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def fit_predictor(
    config_json: str,
    iteration: int,
    start_iteration: int,
    trees: Input[Dataset],
    policy: Input[Model],
    predictor: Input[Model],
    new_predictor: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """The refitted predictor; rows, replayed rows and the weighted MSE before/after."""
    from pathlib import Path

    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.cycle import fit_predictor_step

    config = PipelineConfig.from_json(config_json)
    result = fit_predictor_step(
        config,
        start_iteration + iteration,
        Path(trees.path),
        Path(policy.path),
        Path(predictor.path),
        Path(new_predictor.path),
    )
    for key, value in result.items():
        metrics.log_metric(key, value)
