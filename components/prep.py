"""Data prep: the run parameters become the one config JSON, the task's prompts a Dataset."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Output

from components.images import image


@dsl.component(base_image=image("TRACE_IMAGE"), install_kfp_package=False)
def prep(
    task: str,
    dataset_uri: str,
    retriever_url: str,
    base_model_uri: str,
    strategy: str,
    budget: int,
    continuations: int,
    iterations: int,
    max_staleness: int,
    seed: int,
    checkpoint_every: int,
    keep_checkpoints: int,
    ray_address: str,
    ray_jobs_url: str,
    engine: str,
    rollout_workers: int,
    gpus_per_worker: float,
    run_name: str,
    store_uri: str,
    settings_json: str,
    mlflow_tracking_uri: str,
    pipeline_run_id: str,
    prompts: Output[Dataset],
) -> NamedTuple("PrepOutputs", config_json=str, start=str, start_iteration=int):
    """Parameters → the config (its session named after the KFP run), prompts, the start."""
    from pathlib import Path

    from trace_core.train.contract import PipelineParameters
    from trace_core.train.steps.start import prep_step

    given = locals()  # the run parameters, by name
    parameters = PipelineParameters(**{n: given[n] for n in PipelineParameters.__annotations__})
    result = prep_step(parameters, Path(prompts.path), pipeline_run_id=pipeline_run_id)
    prompts.metadata.update({"task": task, "train": result.prompts, "eval": result.eval_prompts})
    return result.config_json, result.start, result.start_iteration  # PrepOutputs, in order
