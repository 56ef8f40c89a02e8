"""The run parameters are declared once (``trace_core.train.contract.PipelineParameters``); the
KFP pipeline's signature, the prep component's, the Argo workflow's parameters, the local run
and ``trace-rl run-local``'s flags are built from or checked against that one list."""

from __future__ import annotations

import dataclasses

from typer.main import get_command

from components import prep
from pipelines import argo
from pipelines.local import LocalRun
from pipelines.trace_training import PipelineOptions, build_pipeline
from trace_core.cli import app
from trace_core.train.contract import PipelineParameters, parse_parameters

FIELDS = {f.name: f for f in dataclasses.fields(PipelineParameters)}
CLUSTER_ONLY = {
    "gpu_node_selector",
    "gpu_node_affinity",
    "gpu_tolerations",
    "gpus",
    "accelerator",
    "s3_secret",
    "ray_auth_secret",
}
"""Pod placement and Secrets: KFP run parameters that are not training settings."""
KFP_TYPES = {int: "Integer", float: "Float", str: "String"}


def kind(name: str) -> type:
    kinds = {"int": int, int: int, "float": float, float: float}
    return kinds.get(FIELDS[name].type, str)  # type: ignore[call-overload]


def test_the_kfp_pipeline_signature_is_the_run_parameters() -> None:
    inputs = build_pipeline().component_spec.inputs
    assert set(inputs) - CLUSTER_ONLY == set(FIELDS)
    # The compiled package defaults to the kfp overlay's Ray cluster and KFP's store.
    built = PipelineOptions()
    cluster = {"ray_jobs_url": built.ray_jobs_url, "store_uri": built.store_uri}
    for name in set(FIELDS):
        spec = inputs[name]
        assert spec.default == cluster.get(name, FIELDS[name].default), name
        assert spec.type == KFP_TYPES[kind(name)], name


def test_prep_takes_every_run_parameter_in_order() -> None:
    """prep builds ``PipelineParameters(*args)`` positionally: same names, same order; then
    the KFP run's id, which names the run's session."""
    assert list(prep.component_spec.inputs) == [*FIELDS, "pipeline_run_id"]


def test_argo_parameters_are_the_run_parameters() -> None:
    assert list(argo.PARAMETERS) == list(FIELDS)
    defaults = {n: str(f.default) for n, f in FIELDS.items()}
    # Without KFP there is no artifact store: the one difference is the store's default.
    assert {n: v for n, v in argo.PARAMETERS.items() if v != defaults[n]} == {
        "store_uri": "s3://trace-rl/runs"
    }


def test_local_run_and_its_flags_are_the_run_parameters() -> None:
    assert set(LocalRun().parameters()) == set(FIELDS)
    command = get_command(app).commands["run-local"]  # type: ignore[attr-defined]
    flags = {p.name for p in command.params}
    assert set(FIELDS) <= flags and flags - set(FIELDS) == {"output", "s3_endpoint"}


def test_parsed_strings_take_the_fields_types() -> None:
    params = parse_parameters(
        {"budget": "16", "task": "multihop", "seed": "3", "gpus_per_worker": "0.5"}
    )
    assert (params.budget, params.task, params.seed) == (16, "multihop", 3)
    assert params.gpus_per_worker == 0.5
    assert params.continuations == FIELDS["continuations"].default
