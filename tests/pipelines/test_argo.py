"""The Argo manifests (``manifests/argo/``): regenerated, diffed, checked against Argo's schemas.

Each object is validated two ways with ``jsonschema``: against the CRD's ``openAPIV3Schema``
(``../shared/schemas/argo/argoproj.io_*.yaml``, what the API server checks structurally), made
strict so that an unknown field is an error as ``kubectl --validate=strict`` would make it; and
against the definition of its kind in Argo's ``schema.json``. CEL rules in the CRDs are not
evaluated, and nothing here runs a workflow: there is no Argo controller on this machine.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from support import render

from pipelines import argo
from trace_core.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "manifests" / "argo"
SHARED = ROOT.parent / "shared" / "schemas" / "argo"
VENDORED = ROOT / "tests" / "schemas" / "argo"  # gzipped copies of the same files
CRDS = {
    "WorkflowTemplate": "argoproj.io_workflowtemplates.yaml",
    "CronWorkflow": "argoproj.io_cronworkflows.yaml",
    "Workflow": "argoproj.io_workflows.yaml",
}


def _schema_text(name: str) -> str:
    """An upstream Argo schema file: shared/schemas beside the repository, or the vendored copy."""
    if (SHARED / name).is_file():
        return (SHARED / name).read_text()
    return gzip.decompress((VENDORED / f"{name}.gz").read_bytes()).decode()


def _strict(schema: Any) -> Any:
    """Close every object schema that lists its properties (unknown fields become errors)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.Validator:
    crd = yaml.load(_schema_text(CRDS[kind]), Loader=yaml.CSafeLoader)
    (version,) = (v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@functools.cache
def json_schema_validator(kind: str) -> jsonschema.Validator:
    definitions = json.loads(_schema_text("schema.json"))["definitions"]
    schema = {
        "$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{kind}",
        "definitions": definitions,
    }
    return jsonschema.Draft202012Validator(schema)


def problems(validator: jsonschema.Validator, obj: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message[:200]}"
        for e in validator.iter_errors(obj)
    ]


def committed_objects() -> list[dict[str, Any]]:
    """The Argo objects (not the kustomization)."""
    objects = [yaml.safe_load(p.read_text()) for p in sorted(COMMITTED.glob("*.yaml"))]
    return [o for o in objects if o.get("apiVersion") == "argoproj.io/v1alpha1"]


def containers(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = obj["spec"].get("workflowSpec", obj["spec"])
    found = []
    for template in spec.get("templates", []):
        for key in ("container", "script"):
            if key in template:
                found.append((template["name"], template[key]))
        for extra in ("initContainers", "sidecars"):
            found += [(template["name"], c) for c in template.get(extra, [])]
    return found


# --- regenerate and diff ---------------------------------------------------------------------


def test_committed_manifests_are_what_the_generator_writes(tmp_path: Path) -> None:
    written = argo.write_manifests(tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(p.name for p in COMMITTED.iterdir() if p.is_file())
    for path in written:
        committed = (COMMITTED / path.name).read_text()
        assert path.read_text() == committed, (
            f"manifests/argo/{path.name} is stale: run `trace-rl pipeline argo` "
            "(or `python -m pipelines.argo`) and commit the result"
        )


def test_generator_cli_writes_the_same(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["pipeline", "argo", "--output-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name in ("workflowtemplate.yaml", "cronworkflow.yaml", "kustomization.yaml"):
        assert (tmp_path / name).read_text() == (COMMITTED / name).read_text()


def test_kustomization_lists_both_and_builds() -> None:
    kustomization = yaml.safe_load((COMMITTED / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["workflowtemplate.yaml", "cronworkflow.yaml"]
    kinds = [d["kind"] for d in render.kustomize(COMMITTED)]  # no kubectl: fails, says why
    assert sorted(kinds) == ["CronWorkflow", "WorkflowTemplate"]


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["workflowtemplate.yaml", "cronworkflow.yaml"])
def test_every_manifest_is_accepted_by_its_schemas(name: str) -> None:
    obj = yaml.safe_load((COMMITTED / name).read_text())
    assert obj["apiVersion"] == "argoproj.io/v1alpha1"
    assert problems(crd_validator(obj["kind"]), obj) == []
    assert problems(json_schema_validator(obj["kind"]), obj) == []


def test_the_checks_catch_what_they_should() -> None:
    """The validators are not vacuous: a typo, a bad quantity, a missing field each fail."""
    template = yaml.safe_load((COMMITTED / "workflowtemplate.yaml").read_text())
    cron = yaml.safe_load((COMMITTED / "cronworkflow.yaml").read_text())

    typo = copy.deepcopy(template)
    typo["spec"]["templates"][0]["contianer"] = {}
    assert problems(crd_validator("WorkflowTemplate"), typo)

    quantity = copy.deepcopy(template)  # the CRD checks quantities' pattern; schema.json does not
    _, container = containers(quantity)[0]
    container["resources"]["limits"]["memory"] = "lots"
    assert problems(crd_validator("WorkflowTemplate"), quantity)

    mistyped = copy.deepcopy(template)
    _, container = containers(mistyped)[0]
    container["args"] = "step prep"  # a string where a list belongs
    assert problems(crd_validator("WorkflowTemplate"), mistyped)
    assert problems(json_schema_validator("WorkflowTemplate"), mistyped)

    unscheduled = copy.deepcopy(cron)
    del unscheduled["spec"]["schedules"]
    assert problems(crd_validator("CronWorkflow"), unscheduled)
    assert problems(json_schema_validator("CronWorkflow"), unscheduled)


# --- what the manifests promise --------------------------------------------------------------


def test_every_container_is_non_root_with_requests_and_limits() -> None:
    for obj in committed_objects():
        spec = obj["spec"].get("workflowSpec", obj["spec"])
        if "templates" not in spec:
            continue  # the CronWorkflow runs the WorkflowTemplate's
        pod = spec.get("securityContext", {})
        for name, container in containers(obj):
            where = f"{obj['kind']}/{name}"
            context = container.get("securityContext", {})
            assert context.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert context.get("runAsUser", pod.get("runAsUser", 0)) != 0, where
            resources = container.get("resources", {})
            for kind in ("cpu", "memory"):
                assert kind in resources.get("requests", {}), f"{where}: no {kind} request"
                assert kind in resources.get("limits", {}), f"{where}: no {kind} limit"
        assert pod.get("runAsNonRoot") is True
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault"


def test_gpu_steps_ask_for_gpus_and_the_gpu_image() -> None:
    from components.images import image

    template = yaml.safe_load((COMMITTED / "workflowtemplate.yaml").read_text())
    by_name = dict(containers(template))
    assert set(argo.GPU_STEPS) <= set(by_name)
    for name, container in by_name.items():
        limits = container["resources"]["limits"]
        ray = name in argo.RAY_STEPS  # talks to Ray: the cluster's image
        assert container["image"] == image("TRACE_GPU_IMAGE" if ray else "TRACE_IMAGE"), name
        if name in argo.GPU_STEPS:
            assert int(limits["nvidia.com/gpu"]) >= 1, name
        else:
            assert "nvidia.com/gpu" not in limits, name
        # The scratch volumes' sizes and the container's own layer, requested and bounded.
        (pod_spec,) = [t for t in template["spec"]["templates"] if t["name"] == name]
        scratch = sum(
            int(v["emptyDir"]["sizeLimit"].removesuffix("Gi")) for v in pod_spec["volumes"]
        )
        for side in ("requests", "limits"):
            assert container["resources"][side]["ephemeral-storage"] == f"{scratch + 1}Gi", name


def test_credentials_come_only_from_the_secret() -> None:
    text = "\n".join(p.read_text() for p in COMMITTED.glob("*.yaml"))
    for obj in committed_objects():
        for name, container in containers(obj):
            env = {e["name"]: e for e in container.get("env", [])}
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                assert key in env, f"{name}: no {key}"
                assert "value" not in env[key], f"{name}: {key} written literally"
                ref = env[key]["valueFrom"]["secretKeyRef"]
                assert ref["name"] == argo.S3_SECRET
    # Nothing that looks like a key or a password anywhere in the text.
    assert not re.search(r"(?i)(secret_?access_?key|password|token)\s*[:=]\s*['\"]?\w{8,}", text)
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)  # an AWS access key id


def _template_containers() -> list[tuple[str, dict[str, Any]]]:
    return containers(yaml.safe_load((COMMITTED / "workflowtemplate.yaml").read_text()))


def _parse_step(args: list[str]) -> tuple[str, dict[str, list[str]]]:
    """``step NAME --flag value ...`` → NAME and the values of each flag."""
    assert args[0] == "step", args[:2]
    flags: dict[str, list[str]] = {}
    for flag, value in zip(args[2::2], args[3::2], strict=True):
        flags.setdefault(flag, []).append(value)
    return args[1], flags


def _pairs(values: list[str]) -> dict[str, str]:
    return dict(v.split("=", 1) for v in values)


@pytest.mark.parametrize("name", [n for n, _ in _template_containers()])
def test_every_step_uses_the_step_interface(name: str) -> None:
    """``trace-rl step STEP`` with the folders ``argo.STEP_FOLDERS`` lists for it."""
    container = dict(_template_containers())[name]
    assert container["command"] == ["trace-rl"]
    step, flags = _parse_step(container["args"])
    inputs, outputs = argo.STEP_FOLDERS[step]
    assert "--iteration" in flags
    assert ("--param" in flags) == (step == "prep")
    assert ("--config-json" in flags) == (step != "prep")
    assert set(_pairs(flags.get("--input", []))) == set(inputs)
    assert set(_pairs(flags.get("--output", []))) == set(outputs)


RUNNABLE = [n for n, _ in _template_containers()]


def _sample(arg: str) -> str:
    """An Argo placeholder replaced by a value of the kind it will have at run time."""

    def value(match: re.Match[str]) -> str:
        name = match[0]
        if "iteration" in name:
            return "1"
        if "config" in name:
            return "{}"
        return "s3://trace-rl/runs/staging/wf/x"

    return re.sub(r"\{\{=?[^}]*\}\}", value, arg)


@pytest.mark.parametrize("name", RUNNABLE)
def test_trace_rl_step_accepts_the_command(name: str) -> None:
    """The CLI parses the command line, the step gets exactly its folders, and prep's run
    parameters parse into a valid config."""
    import typer.main

    from trace_core.train.contract import check_step_folders, parse_parameters

    container = dict(_template_containers())[name]
    args = [_sample(a) for a in container["args"]]
    command = typer.main.get_command(app).commands["step"]  # type: ignore[attr-defined]
    try:
        context = command.make_context("step", args[1:])
    except Exception as err:  # click's usage errors: an unknown or missing flag
        raise ValueError(f"trace-rl rejects {args[:2]}: {err}") from err
    step, flags = _parse_step(args)
    assert context.params["iteration"] >= 0
    check_step_folders(step, _pairs(flags.get("--input", [])), _pairs(flags.get("--output", [])))
    if step == "prep":  # the workflow's parameters, at their defaults, make a valid config
        template = yaml.safe_load((COMMITTED / "workflowtemplate.yaml").read_text())
        default = {p["name"]: p["value"] for p in template["spec"]["arguments"]["parameters"]}
        raw = _pairs(_parse_step(container["args"])[1]["--param"])
        values = {k: default[k] if "{{" in v else v for k, v in raw.items()}
        train = parse_parameters(values).config().train
        assert train.iterations == argo.ArgoOptions().iterations
        assert train.max_staleness == int(default["max_staleness"])
        assert default["retriever_url"] == "" and train.retriever_url is None  # in process


def test_cron_workflow_references_the_template_and_resumes() -> None:
    cron = yaml.safe_load((COMMITTED / "cronworkflow.yaml").read_text())
    template = yaml.safe_load((COMMITTED / "workflowtemplate.yaml").read_text())
    spec = cron["spec"]
    assert spec["workflowSpec"]["workflowTemplateRef"] == {"name": template["metadata"]["name"]}
    assert spec["concurrencyPolicy"] == "Forbid"  # KFP's max_concurrency=1
    assert all(len(s.split()) == 5 for s in spec["schedules"])  # Argo's cron has no seconds
    args = {p["name"]: p["value"] for p in spec["workflowSpec"]["arguments"]["parameters"]}
    declared = {p["name"] for p in template["spec"]["arguments"]["parameters"]}
    assert set(args) <= declared
    assert args["run_name"]  # the same run every time: each workflow resumes its latest


def _workflow_template() -> dict[str, Any]:
    return yaml.safe_load((COMMITTED / "workflowtemplate.yaml").read_text())


def _dag(template: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The tasks of the DAG template ``name``, by task name."""
    (dag,) = [t for t in template["spec"]["templates"] if t["name"] == name]
    return {task["name"]: task for task in dag["dag"]["tasks"]}


def _arguments(task: dict[str, Any]) -> dict[str, str]:
    return {p["name"]: p["value"] for p in task["arguments"]["parameters"]}


def test_every_run_parameter_is_a_workflow_parameter_and_reaches_prep() -> None:
    """Same names, order and defaults as ``PipelineParameters`` (store_uri's aside: no KFP
    store), iterations and max_staleness included; prep gets every one as ``--param``."""
    import dataclasses

    from trace_core.train.contract import PipelineParameters

    fields = {f.name: str(f.default) for f in dataclasses.fields(PipelineParameters)}
    template = _workflow_template()
    declared = {p["name"]: p["value"] for p in template["spec"]["arguments"]["parameters"]}
    assert list(declared) == list(fields) == list(argo.PARAMETERS)
    assert {"iterations", "max_staleness", "retriever_url"} <= set(declared)
    assert {n: v for n, v in declared.items() if v != fields[n]} == {
        "store_uri": "s3://trace-rl/runs"
    }
    assert declared["iterations"] == str(argo.ArgoOptions().iterations) == fields["iterations"]
    prep = dict(_template_containers())["prep"]
    raw = _pairs(_parse_step(prep["args"])[1]["--param"])
    assert raw == {n: f"{{{{workflow.parameters.{n}}}}}" for n in fields}


def test_generating_with_other_iterations_only_changes_the_default() -> None:
    built = argo.build_template(argo.ArgoOptions(iterations=7)).to_dict()
    declared = {p["name"]: p["value"] for p in built["spec"]["arguments"]["parameters"]}
    assert declared["iterations"] == "7"
    with pytest.raises(ValueError, match="iterations"):
        argo.ArgoOptions(iterations=0)


def test_the_iterations_are_one_task_looped_one_at_a_time() -> None:
    """No unrolled iterate-i: the DAG ``train`` runs the template ``iterations`` once; in it,
    one task ``iterate`` with ``withSequence`` over the run's iteration numbers, ``parallelism:
    1`` (Argo starts the expanded children in order, one when the one before has ended) and
    ``failFast`` (none after one failed)."""
    template = _workflow_template()
    train = _dag(template, "train")
    assert not any(re.fullmatch(r"iterate-\d+", name) for name in train)
    assert [n for n, t in train.items() if t["template"] in ("iterate", "iterations")] == [
        "iterations"
    ]
    loop = train["iterations"]
    assert loop["template"] == "iterations" and loop["depends"] == "open-session"
    assert _arguments(loop)["count"] == "{{workflow.parameters.iterations}}"
    assert train["close-session"]["depends"] == "iterations"
    assert train["report"]["depends"] == "close-session"

    (spec,) = [t for t in template["spec"]["templates"] if t["name"] == "iterations"]
    assert spec["parallelism"] == 1
    assert spec["failFast"] is True
    (task,) = spec["dag"]["tasks"]
    assert task["name"] == "iterate" and task["template"] == "iterate"
    assert "depends" not in task and "when" not in task
    sequence = task["withSequence"]
    assert set(sequence) == {"start", "count"}  # not ``end``: a descending range never runs
    assert sequence["count"] == "{{inputs.parameters.count}}"
    assert sequence["start"] == "{{inputs.parameters.first}}"
    assert {p["name"] for p in spec["inputs"]["parameters"]} == {"config", "first", "count"}
    uses = [
        (dag["name"], t["name"])
        for dag in template["spec"]["templates"]
        if "dag" in dag
        for t in dag["dag"]["tasks"]
        if t["template"] == "iterate"
    ]
    assert uses == [("iterations", "iterate")]


def _resolve(text: str, env: dict[str, str]) -> str:
    """Argo's substitution, for the tags this template uses: ``{{name}}`` and ``{{=expr}}``
    with ``asInt`` and integer arithmetic on the variables in ``env``."""

    def expression(match: re.Match[str]) -> str:
        names = re.sub(
            r"[A-Za-z_][\w.-]*",
            lambda name: repr(env[name[0]]) if name[0] in env else name[0],
            match[1],
        )
        assert set(re.findall(r"[A-Za-z_]\w*", names)) <= {"asInt"}, names  # all resolved
        return str(eval(names, {"__builtins__": {}}, {"asInt": int}))

    text = re.sub(r"\{\{=(.*?)\}\}", expression, text)
    return re.sub(r"\{\{([^=][^}]*)\}\}", lambda name: env[name[1].strip()], text)


@pytest.mark.parametrize(("start", "iterations"), [(0, 4), (0, 1), (7, 3)])
def test_each_iteration_reads_the_state_the_one_before_wrote(start: int, iterations: int) -> None:
    """Resolved as Argo would for a run resuming after iteration ``start``: open-session writes
    state-S; the loop's children run S+1..S+K in order, child N reading state-(N-1) and
    writing state-N and iter-N/trees; close-session and report read the last one's."""
    template = _workflow_template()
    train = _dag(template, "train")
    staging = "s3://b/runs/staging/wf"
    env = {
        "workflow.parameters.store_uri": "s3://b/runs",
        "workflow.name": "wf",
        "workflow.parameters.iterations": str(iterations),
        "tasks.prep.outputs.parameters.start_iteration": str(start),
        "tasks.prep.outputs.parameters.config": "{}",
    }

    def arguments(task: dict[str, Any], scope: dict[str, str]) -> dict[str, str]:
        return {k: _resolve(v, scope) for k, v in _arguments(task).items()}

    opened = arguments(train["open-session"], env)
    assert (opened["iteration"], opened["state"]) == (str(start), f"{staging}/state-{start}")

    inputs = arguments(train["iterations"], env)
    scope = env | {f"inputs.parameters.{k}": v for k, v in inputs.items()}
    (task,) = _dag(template, "iterations").values()
    first = int(_resolve(task["withSequence"]["start"], scope))
    count = int(_resolve(task["withSequence"]["count"], scope))
    assert (first, count) == (start + 1, iterations)
    state = opened["state"]
    for item in range(first, first + count):  # the order parallelism 1 runs them in
        child = arguments(task, scope | {"item": str(item)})
        assert child["iteration"] == str(item)
        assert child["state"] == state  # the one before's
        assert child["new_state"] == f"{staging}/state-{item}"
        assert child["trees"] == f"{staging}/iter-{item}/trees"
        state, trees = child["new_state"], child["trees"]

    last = start + iterations
    assert state == f"{staging}/state-{last}"
    closed = arguments(train["close-session"], env)
    assert closed["state"] == state
    report = arguments(train["report"], env)
    assert (report["state"], report["trees"]) == (state, trees)
    assert report["start_eval"] == opened["state"]
    assert report["final_eval"] == closed["result"]


def test_parameters_match_the_kfp_pipeline() -> None:
    """The KFP package's run parameters that the workflow has too take the same defaults (the
    store and the Ray cluster aside: the KFP package defaults to KFP's store and the kfp
    overlay's head)."""
    from pipelines.client import DEFAULT_PACKAGE, read_package

    kfp = read_package(DEFAULT_PACKAGE).parameters
    shared = [name for name in argo.PARAMETERS if name in kfp]
    assert {"task", "budget", "seed", "run_name", "settings_json"} <= set(shared)
    for name in shared:
        default = kfp[name].default
        if name in ("store_uri", "ray_jobs_url"):  # KFP's: its store, the kfp overlay's head
            continue
        value = argo.PARAMETERS[name]
        if isinstance(default, float):  # KFP writes every number as a float: 128.0
            assert float(value) == default, name
        else:
            assert str(default) == value, name
