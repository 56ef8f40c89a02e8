"""Schedule: the iterations the run's iteration step runs, one after another."""

from kfp import dsl

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def schedule(config_json: str, start_iteration: int) -> list:
    """[start_iteration + 1, ..., start_iteration + iterations]: the items of the pipeline's
    sequential loop over ``iterate`` (the run parameter ``iterations`` sets how many)."""
    from trace_core.train.contract import PipelineConfig
    from trace_core.train.steps.handoff import iterations

    return iterations(PipelineConfig.from_json(config_json), start_iteration)
