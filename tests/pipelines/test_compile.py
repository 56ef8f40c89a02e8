"""The compiled pipeline: committed YAML equals a fresh compile, parses strictly as KFP's
``PipelineSpec`` and ``PlatformSpec`` protobufs, and holds the cluster settings the issue asks
for (GPUs, Secrets, caching, images); components stay thin."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s_pb
from kfp.pipeline_spec import pipeline_spec_pb2 as pb

import components
from components.images import read_images
from pipelines.trace_training import COMPILED, PipelineOptions, compile_pipeline


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = compile_pipeline(tmp_path_factory.mktemp("compiled") / "trace_training.yaml")
    fresh = path.read_text()
    assert COMPILED.read_text() == fresh, (
        f"{COMPILED} is stale: run `python -m pipelines.trace_training` and commit the result"
    )
    return list(yaml.safe_load_all(fresh))


def test_committed_yaml_parses_strictly(docs: list[dict]) -> None:
    pipeline_doc, platform_doc = docs  # the pipeline spec, then the Kubernetes platform spec
    spec = json_format.ParseDict(pipeline_doc, pb.PipelineSpec(), ignore_unknown_fields=False)
    platform = json_format.ParseDict(platform_doc, pb.PlatformSpec(), ignore_unknown_fields=False)
    assert spec.pipeline_info.name == "trace-training"
    parameters = set(spec.root.input_definitions.parameters)
    assert {
        "task", "dataset_uri", "base_model_uri", "strategy", "budget", "continuations", "seed",
        "checkpoint_every", "keep_checkpoints", "ray_address", "ray_jobs_url", "run_name",
        "store_uri",
        "settings_json", "gpus", "accelerator",
        "gpu_node_selector", "gpu_node_affinity", "gpu_tolerations", "s3_secret",
        "ray_auth_secret",
    } <= parameters  # fmt: skip
    for name, executor in platform.platforms["kubernetes"].deployment_spec.executors.items():
        config = json_format.ParseDict(
            json_format.MessageToDict(executor), k8s_pb.KubernetesExecutorConfig()
        )
        env = {e.env_var for secret in config.secret_as_env for e in secret.key_to_env}
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env, name
        gpu = name.startswith(("exec-open-session", "exec-iterate"))
        ray = gpu or name.startswith(("exec-close-session", "exec-release-session"))
        assert ("RAY_AUTH_TOKEN" in env) == ray, name
        assert bool(config.tolerations) == gpu and config.HasField("node_selector") == gpu
        assert len(config.node_affinity) == gpu, name  # the run parameter gpu_node_affinity


def _tasks(spec: dict) -> dict[str, dict]:
    """Every task of every DAG, by task name."""
    found = {}
    for component in spec["components"].values():
        found.update(component.get("dag", {}).get("tasks", {}))
    return found


def test_gpu_caching_and_images(docs: list[dict]) -> None:
    spec = docs[0]
    executors = spec["deploymentSpec"]["executors"]
    tasks = _tasks(spec)
    images = read_images()
    iterations = [t for name, t in tasks.items() if name.startswith("iterate")]
    assert len(iterations) == 2  # one loop in each start branch
    for name, task in tasks.items():
        kind = name.rstrip("-0123456789")
        if kind.startswith(("condition", "for-loop")):
            continue
        container = executors[task["componentRef"]["name"].replace("comp-", "exec-", 1)][
            "container"
        ]
        gpu = kind in ("open-session", "iterate")
        ray = gpu or kind in ("close-session", "release-session")  # the cluster's Python, Ray
        assert container["image"] == images["TRACE_GPU_IMAGE" if ray else "TRACE_IMAGE"], name
        assert ("accelerator" in container.get("resources", {})) == gpu, name
        sizes = container["resources"]  # every step pod is sized: requests and limits
        for key in ("CpuRequest", "CpuLimit", "MemoryRequest", "MemoryLimit"):
            assert sizes[f"resource{key}"], (name, key)
        cached = task.get("cachingOptions", {}).get("enableCache", False)
        if kind not in ("warmstart", "schedule", "report"):  # registry, actors: not pure
            assert not cached, f"{name} must not be cached"
        assert "pip install" not in " ".join(container["command"]), name  # image has it all


def test_warm_start_sits_under_a_condition(docs: list[dict]) -> None:
    """If/Else on prep's start: warmstart in one branch, load in the other, each holding the
    session: open, the iterations' loop, close, report."""
    spec = docs[0]
    (branches,) = [n for n in spec["components"] if n.startswith("comp-condition-branches")]
    conditions = {
        task["componentRef"]["name"]: task["triggerPolicy"]["condition"]
        for task in spec["components"][branches]["dag"]["tasks"].values()
    }
    warm = [c for c, rule in conditions.items() if rule.endswith("== 'warmstart'")]
    load = [c for c, rule in conditions.items() if rule.startswith("!(")]
    for component, first in ((warm, "warmstart"), (load, "load")):
        (name,) = component
        tasks = spec["components"][name]["dag"]["tasks"]
        assert first in tasks and sum(t.startswith("for-loop") for t in tasks) == 1
    assert not any(t.startswith(("warmstart", "iterate")) for t in spec["root"]["dag"]["tasks"])


def test_the_iterations_are_a_loop_one_at_a_time_over_the_run_parameter(
    docs: list[dict],
) -> None:
    """``iterations`` is a run parameter: schedule lists the run's iterations, and one
    ``iterate`` runs per item, one after another (parallelism 1), after open-session and
    before close-session, whatever the count: the DAG's size does not grow with it."""
    spec = docs[0]
    assert spec["root"]["inputDefinitions"]["parameters"]["iterations"]["defaultValue"] == (
        PipelineOptions().iterations
    )
    assert "max_staleness" in spec["root"]["inputDefinitions"]["parameters"]
    retriever = spec["root"]["inputDefinitions"]["parameters"]["retriever_url"]
    assert retriever == {"defaultValue": "", "isOptional": True, "parameterType": "STRING"}
    tasks = _tasks(spec)
    assert tasks["schedule"]["inputs"]["parameters"]["config_json"]
    loops = {name: task for name, task in tasks.items() if name.startswith("for-loop")}
    assert len(loops) == 2
    for name, loop in loops.items():
        assert loop["iteratorPolicy"] == {"parallelismLimit": 1}
        assert loop["parameterIterator"]["items"] == {
            "inputParameter": "pipelinechannel--schedule-Output"
        }
        assert loop["dependentTasks"][0].startswith("open-session")
        (inner,) = spec["components"][loop["componentRef"]["name"]]["dag"]["tasks"].values()
        assert inner["componentRef"]["name"].startswith("comp-iterate")
        item = inner["inputs"]["parameters"]["iteration"]["componentInputParameter"]
        assert item == loop["parameterIterator"]["itemInput"]
        closes = [t for t in tasks.values() if name in t.get("dependentTasks", [])]
        assert [t["taskInfo"]["name"] for t in closes] == ["close-session"]
    assert len(tasks) == 17  # below the root, for any number of iterations


@pytest.mark.parametrize("component", components.__all__)
def test_components_are_thin(component: str) -> None:
    """≤ 40 lines each, heavy imports inside the body, one call into a step function
    (``trace_core.train.steps``, or ``train.dispatch.run_step`` for the steps Ray may run)."""
    func = getattr(components, component).python_func
    source = inspect.getsource(func)
    assert len(source.splitlines()) <= 40, f"{component}: {len(source.splitlines())} lines"
    assert "from trace_core.train.contract import" in source
    assert "from trace_core.train.steps." in source or "from trace_core.train.dispatch" in source
    module = Path(inspect.getsourcefile(func) or "").read_text()
    header = module[: module.index("@dsl.component")]
    assert "trace_core" not in header and "torch" not in header


def test_compile_command_takes_the_iterations_and_the_s3_endpoint(tmp_path: Path) -> None:
    """`trace-rl pipeline compile --iterations 2 --s3-endpoint ...`: the run parameter
    iterations defaults to 2, and every step's AWS_ENDPOINT_URL_S3 is the endpoint given. The
    command's defaults are the committed package's."""
    from typer.testing import CliRunner

    from trace_core.cli import app
    from trace_core.cli.pipeline import pipeline_compile

    out = tmp_path / "p.yaml"
    endpoint = "http://minio-service.kubeflow:9000"
    args = ["pipeline", "compile", "--output", str(out), "--iterations", "2"]
    done = CliRunner().invoke(app, [*args, "--s3-endpoint", endpoint])
    assert done.exit_code == 0, done.output
    spec = next(yaml.safe_load_all(out.read_text()))
    assert spec["root"]["inputDefinitions"]["parameters"]["iterations"]["defaultValue"] == 2
    for executor in spec["deploymentSpec"]["executors"].values():
        env = {e["name"]: e["value"] for e in executor["container"].get("env", [])}
        assert env["AWS_ENDPOINT_URL_S3"] == endpoint
    defaults = inspect.signature(pipeline_compile).parameters
    assert defaults["iterations"].default == PipelineOptions().iterations
    assert defaults["s3_endpoint"].default == PipelineOptions().s3_endpoint
    assert defaults["ray_jobs_url"].default == PipelineOptions().ray_jobs_url
    assert defaults["store_uri"].default == PipelineOptions().store_uri
    refused = CliRunner().invoke(app, [*args, "--s3-endpoint", "minio:9000"])
    assert refused.exit_code == 2 and "s3_endpoint 'minio:9000'" in refused.output


def test_compile_command_takes_the_images_and_pull_secrets(tmp_path: Path) -> None:
    """`--image`, `--gpu-image`, `--image-pull-secret`: every executor runs the image given
    for its kind of step, and every task pulls with the secrets."""
    from typer.testing import CliRunner

    from trace_core.cli import app

    out = tmp_path / "p.yaml"
    cpu, gpu = "registry.corp:5000/ml/trace:2.0", "registry.corp:5000/ml/trace-gpu:2.0"
    args = ["pipeline", "compile", "--output", str(out), "--image", cpu, "--gpu-image", gpu]
    args += ["--image-pull-secret", "corp-registry", "--image-pull-secret", "mirror"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    spec, platform = yaml.safe_load_all(out.read_text())
    images = {
        name: executor["container"]["image"]
        for name, executor in spec["deploymentSpec"]["executors"].items()
    }
    assert {i for name, i in images.items() if "iterate" in name} == {gpu}
    assert {i for name, i in images.items() if "prep" in name or "report" in name} == {cpu}
    assert set(images.values()) == {cpu, gpu}
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(images)
    for config in executors.values():
        secrets = [s["secretName"] for s in config["imagePullSecret"]]
        assert secrets == ["corp-registry", "mirror"]
    refused = CliRunner().invoke(app, [*args[:4], "--image-pull-secret", "Corp_Registry"])
    assert refused.exit_code == 2 and "'Corp_Registry': not a Kubernetes Secret name" in (
        refused.output
    )


def test_the_cluster_is_the_default_and_its_gpus_are_the_workers(
    docs: list[dict], tmp_path: Path
) -> None:
    """The committed pipeline's runs submit to the kfp overlay's Ray head unless told
    otherwise, and then ask for no GPU in their own pods; compiled without a cluster, the
    session's steps ask for one GPU on a node whose driver runs the GPU image."""
    from pipelines.trace_training import GPU_NODE_AFFINITY, RAY_JOBS_URL

    def defaults(spec: dict) -> dict[str, object]:
        parameters = spec["root"]["inputDefinitions"]["parameters"]
        return {name: p.get("defaultValue") for name, p in parameters.items()}

    committed = defaults(docs[0])
    assert committed["ray_jobs_url"] == RAY_JOBS_URL == PipelineOptions().ray_jobs_url
    assert committed["gpus"] == 0.0 and committed["gpu_node_affinity"] == {}
    build = PipelineOptions(ray_jobs_url="")
    path = compile_pipeline(tmp_path / "alone.yaml", build)
    alone = defaults(next(yaml.safe_load_all(path.read_text())))
    assert alone["ray_jobs_url"] == "" and alone["gpus"] == 1.0
    assert alone["gpu_node_affinity"] == GPU_NODE_AFFINITY
    with pytest.raises(ValueError, match="ray_jobs_url 'trace-rl-head:8265'"):
        PipelineOptions(ray_jobs_url="trace-rl-head:8265")


def test_compile_command_gives_the_runs_a_store_of_their_own(tmp_path: Path) -> None:
    """`--run-store-endpoint` (and `--run-store-secret`): every step is told the run store's
    bucket (store_uri's) and endpoint and gets its keys from that Secret, beside KFP's store's;
    the committed package has no run store."""
    from typer.testing import CliRunner

    from trace_core.cli import app
    from trace_core.train.rayjob import PASSED_ENV

    out = tmp_path / "p.yaml"
    args = ["pipeline", "compile", "--output", str(out), "--store-uri", "s3://weights/trace"]
    args += ["--run-store-endpoint", "http://weights.storage.svc:9000"]
    done = CliRunner().invoke(app, [*args, "--run-store-secret", "weights-keys"])
    assert done.exit_code == 0, done.output
    spec, platform = yaml.safe_load_all(out.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, executor in spec["deploymentSpec"]["executors"].items():
        env = {e["name"]: e["value"] for e in executor["container"].get("env", [])}
        assert env["TRACE_STORE_BUCKET"] == "weights", name
        assert env["TRACE_STORE_ENDPOINT_URL"] == "http://weights.storage.svc:9000", name
        assert env["AWS_ENDPOINT_URL_S3"] == PipelineOptions().s3_endpoint, name
        secrets = {s.get("secretName"): s for s in executors[name]["secretAsEnv"]}
        keys = {k["secretKey"]: k["envVar"] for k in secrets["weights-keys"]["keyToEnv"]}
        assert keys == {
            "AWS_ACCESS_KEY_ID": "TRACE_STORE_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY": "TRACE_STORE_SECRET_ACCESS_KEY",
        }
    # A step's Ray job is told the same (never the keys: the Ray pods hold their own).
    assert {"TRACE_STORE_BUCKET", "TRACE_STORE_ENDPOINT_URL"} <= set(PASSED_ENV)
    assert not any("KEY" in name for name in PASSED_ENV)
    assert "TRACE_STORE" not in COMPILED.read_text()
    refused = CliRunner().invoke(app, [*args[:4], "--run-store-endpoint", "weights:9000"])
    assert refused.exit_code == 2 and "run_store_endpoint 'weights:9000'" in refused.output
