"""docs/deploy.md, run: every command of the deploy guide, in the guide's order, in one shell in a
copy of the repository, as printed, where this machine allows it.

- the pipeline commands (compile, upload, run, schedule, runs, argo) run as printed; KFP is a
  stand-in API on 127.0.0.1 (``kfp_standin.py``), so ``export KFP_HOST=...`` points there;
- ``kubectl apply -k DIR`` is built offline (``kubectl kustomize DIR``), with the Secret env
  file the cluster would have filled made from its example;
- the commands that need a live cluster or a registry are listed in ``RULES`` with the reason.

A command in the guide that no rule accounts for fails the test, so a new one cannot go untried.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.commands import commands
from support.kfp_standin import API, StandIn, serving
from support.printed import CLUSTER, HOST, KUSTOMIZE, RUN, S3_ENV, run_printed
from support.repo_copy import REPO, repository_copy

GUIDE = REPO / "docs" / "deploy.md"

# (pattern, what the test does, why) for each command of the guide.
RULES: list[tuple[str, str, str]] = [
    (r"make setup", RUN, ""),
    (r"source \.venv/bin/activate", RUN, ""),
    (r"make manifests", RUN, ""),
    (r"make images push", RUN, "fails here, naming what it cannot run: no container engine"),
    (r"kubectl -n \S+ create secret docker-registry .*", CLUSTER, "creates a Secret in a cluster"),
    (r'echo "auth_token=\$\(openssl rand -hex 32\)" > \S+', RUN, ""),
    (
        r"kubectl -n kubeflow get secret mlpipeline-minio-artifact .*",
        S3_ENV,
        "reads KFP's Secret from a cluster; here s3.env is made from its example",
    ),
    (r"kubectl apply -k (\S+)", KUSTOMIZE, "applies to a cluster; here built offline"),
    (r"kubectl -n trace-rl get raycluster trace-rl", CLUSTER, "reads a live RayCluster"),
    (
        r"kubectl -n (kubeflow|trace-rl) create secret generic trace-store .*",
        CLUSTER,
        "creates a Secret in a cluster",
    ),
    (r"kubectl -n trace-rl patch configmap trace-rl-settings .*", CLUSTER, "edits a live object"),
    (r"kubectl -n trace-rl delete pod -l ray\.io/cluster=trace-rl", CLUSTER, "restarts pods"),
    (
        r"trace-rl cluster check",
        CLUSTER,
        "reads a cluster's nodes (tests/pipelines/test_cluster_check.py runs it as printed, with "
        "a stand-in kubectl answering for nodes of the three big clouds)",
    ),
    (r"kubectl -n kubeflow port-forward .*", CLUSTER, "forwards a port of a cluster's service"),
    (r"kubectl -n trace-rl port-forward .*", CLUSTER, "forwards a port of a cluster's service"),
    (
        r"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=.*",
        CLUSTER,
        "reads the token of a cluster's Secret",
    ),
    (r"ray job (list|logs) .*", CLUSTER, "asks a live Ray head through the port-forward"),
    (r"export KFP_HOST=\S+", HOST, "KFP here is a stand-in on 127.0.0.1"),
    (r"trace-rl pipeline (compile|upload|run|schedule|runs|argo)( .*)?", RUN, ""),
    (
        r"trace-rl model upload /data/models/\S+ s3://\S+",
        CLUSTER,
        "a model folder of the user's and the cluster's store (test_cli_commands.py runs it)",
    ),
    (r"argo submit .*", CLUSTER, "submits to a cluster's Argo controller"),
    (
        r"trace-rl retriever build --corpus corpus\.parquet .* --output s3://\S+",
        CLUSTER,
        "a corpus of the user's and the cluster's store",
    ),
    (
        r"kubectl -n trace-rl rollout status deployment/trace-retriever .*",
        CLUSTER,
        "waits for a live Deployment",
    ),
]


def rule_of(command: str) -> tuple[str, str, str]:
    matched = [rule for rule in RULES if re.fullmatch(rule[0], command)]
    assert len(matched) == 1, f"docs/deploy.md: {command!r} matches {len(matched)} rules"
    return matched[0]


def test_every_command_is_accounted_for() -> None:
    lines = commands(GUIDE.read_text())
    assert len(lines) >= 15
    for command in lines:
        rule_of(command)
    for pattern, _, _ in RULES:  # and no rule outlives its command
        assert any(re.fullmatch(pattern, c) for c in lines), f"no command for rule {pattern}"


def test_comments_and_continuations() -> None:
    text = '```bash\na --x "#1" \\\n   --y  # the y\n# only a comment\nb\n```\n```text\nc\n```\n'
    assert commands(text) == ['a --x "#1" --y', "b"]


@pytest.mark.slow
def test_the_guide_runs(tmp_path: Path) -> None:
    repo = repository_copy(tmp_path / "repo")
    home = tmp_path / "home"
    home.mkdir()
    lines = commands(GUIDE.read_text())
    checkout = [
        REPO / "manifests/argo/workflowtemplate.yaml",
        REPO / "pipelines/compiled/trace_training.yaml",
    ]
    before = [path.stat().st_mtime_ns for path in checkout]
    with serving(StandIn()) as kfp:
        ran = run_printed(repo, lines, lambda command: rule_of(command)[1], kfp.url, home)
    output = ran.output
    assert [path.stat().st_mtime_ns for path in checkout] == before, "wrote into the checkout"
    engine = shutil.which("buildah") or (
        shutil.which("docker")
        and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )
    for n, command in enumerate(lines):
        if command == "make images push" and not engine:
            assert ran.status[n] != 0 and "no container engine" in output, output[-3000:]
        else:
            assert ran.status[n] == 0, (command, output[-3000:])

    # What the commands made: the Ray token, the compiled package with the pull secret, the
    # Argo manifests for the choices, the overlays' builds.
    token = (repo / "manifests/secrets/ray-auth/ray-auth.env").read_text().strip()
    assert re.fullmatch(r"auth_token=[0-9a-f]{64}", token)
    spec, platform = yaml.safe_load_all((repo / "build/trace_training.yaml").read_text())
    assert spec["pipelineInfo"]["name"] == "trace-training"
    for config in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        assert [s["secretName"] for s in config["imagePullSecret"]] == ["trace-registry"]
    # The package whose runs keep their weights on a store of their own (section 7).
    spec = next(yaml.safe_load_all((repo / "build/trace_training-run-store.yaml").read_text()))
    for executor in spec["deploymentSpec"]["executors"].values():
        env = {e["name"]: e["value"] for e in executor["container"]["env"]}
        assert env["TRACE_STORE_BUCKET"] == "trace-weights"
    template = yaml.safe_load((repo / "manifests/argo/workflowtemplate.yaml").read_text())
    assert template["spec"]["imagePullSecrets"] == [{"name": "trace-registry"}]
    assert list((repo / "build").glob("kustomize-*.yaml"))

    # What KFP was asked: the package uploaded, the smoke run and the real run with their
    # parameters, the schedule, the list of runs.
    calls = kfp.calls()
    assert ("POST", f"{API}/pipelines/upload") in calls
    started = [r.body for r in kfp.requests if (r.method, r.path) == ("POST", f"{API}/runs")]
    assert len(started) == 4  # the smoke test, the real run, Qwen3-8B, the retriever's run
    smoke = started[0]["runtime_config"]["parameters"]  # type: ignore[index]
    assert smoke["run_name"] == "smoke" and smoke["budget"] == 8 and smoke["ray_jobs_url"] == ""
    assert "gpus" not in smoke  # the package's default: 0 (the GPUs are the Ray cluster's)
    assert json.loads(smoke["settings_json"]) == {
        "prompts": 16, "eval_tasks": 8, "eval_k": 1, "warmstart_steps": 20,
    }  # fmt: skip
    multihop = started[3]["runtime_config"]["parameters"]  # type: ignore[index]
    assert multihop["task"] == "multihop"
    assert multihop["retriever_url"] == "http://trace-retriever.trace-rl.svc.cluster.local:8000"
    scheduled = kfp.last("POST", f"{API}/recurringruns").body
    assert scheduled["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"  # type: ignore[index]
    assert ("GET", f"{API}/runs") in calls
    assert "started run 'smoke-" in output


GPU_MEMORY_GIB = 80 * 10**9 / 2**30
"""The GPU the guide's shapes assume: 80 GB (H100 and A100 80 GB)."""


def test_the_qwen3_8b_parameter_set_fits_the_kfp_overlay(tmp_path: Path) -> None:
    """The guide's Qwen3-8B command: its parameters are the pipeline's and make a valid run
    config, and what they ask fits the rendered kfp overlay's RayCluster (GPUs of the group the
    engines and trainers land on, a pod's host memory) and an 80 GB GPU (the update's estimate
    sharded over the FSDP ranks; an engine's bf16 weights)."""
    import shlex

    from support import render

    from pipelines.client import DEFAULT_PACKAGE, build_params, read_package
    from pipelines.trace_training import PipelineOptions
    from trace_core.policy.memory import GIB, QWEN3, estimate_update
    from trace_core.train.contract import PipelineParameters

    (command,) = [c for c in commands(GUIDE.read_text()) if "--run-name qwen3-8b" in c]
    words = shlex.split(command)
    assignments = [words[i + 1] for i, word in enumerate(words) if word == "--param"]
    sent = build_params(read_package(DEFAULT_PACKAGE), assignments, "qwen3-8b-bfcl")
    fields = {f.name for f in dataclasses.fields(PipelineParameters)}
    config = PipelineParameters(**{k: v for k, v in sent.items() if k in fields}).config()
    train, engine = config.train, config.train.engine
    assert sent["ray_jobs_url"] == PipelineOptions().ray_jobs_url and sent["gpus"] == 0
    assert config.store.startswith("s3://mlpipeline/shared/")
    assert str(train.init).startswith(config.store) and engine.engine == "vllm"
    assert train.train_gpus and train.train_fsdp and train.update.checkpointing

    (cluster,) = [o for o in render.build_all(tmp_path)["kfp"] if o["kind"] == "RayCluster"]
    (gpu,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    (container,) = gpu["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    per_pod = int(limits["nvidia.com/gpu"])  # one pod per node, all its GPUs
    assert engine.tensor_parallel == 1 and per_pod == engine.gpus_per_node == 8
    asked = engine.workers * engine.gpus_per_worker + train.train_workers
    assert asked <= gpu["maxReplicas"] * per_pod, (asked, gpu["maxReplicas"])

    shape = QWEN3["8B"]
    update = estimate_update(shape, train.update.micro_tokens or 4096, checkpointing=True)
    sharded = update.weights + update.gradients + update.optimizer + update.cast
    per_gpu = sharded / train.train_workers + update.activations + update.head
    assert per_gpu / GIB < 0.9 * GPU_MEMORY_GIB, per_gpu / GIB
    assert 2 * shape.parameters / GIB < 0.5 * GPU_MEMORY_GIB  # bf16 weights: half for KV cache
    shm = [v for v in gpu["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    pod = _gibibytes(limits["memory"]) - _gibibytes(shm[0]["emptyDir"]["sizeLimit"])
    # Every rank on one pod, each reading AdamW's state whole as it loads (8 bytes a parameter),
    # and rank 0 gathering the fp32 weights and AdamW's state for a checkpoint (12).
    assert (8 * train.train_workers + 12) * shape.parameters / GIB < pod


def _gibibytes(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    return float(quantity[:-2]) * units[quantity[-2:]]
