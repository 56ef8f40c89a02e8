"""``trace-rl cluster check`` against nodes shaped like the three big clouds' 8 × H100 nodes
(tests/data/nodes/, values in its README): the node-shaped GPU worker pod of the rendered kfp
overlay fits GKE's a3-highgpu-8g, EKS's p5.48xlarge and AKS's ND96isr H100 v5, and each node that
does not fit (a 100 GB boot disk, 900 GiB of memory, 4 GPUs, an R535 driver, a taint the pod does
not tolerate) is named on a FAIL line with the resource and the shortfall. The command runs as
docs/deploy.md prints it, through the installed ``trace-rl`` script, with a stand-in kubectl
answering ``kubectl get nodes -o json``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support.commands import commands
from support.repo_copy import REPO
from typer.testing import CliRunner

from pipelines import cluster_check as check
from pipelines import node_fit as fit
from pipelines.client import DEFAULT_PACKAGE, build_params, read_package
from trace_core.cli import app
from trace_core.train.contract import PipelineParameters

NODES = REPO / "tests" / "data" / "nodes"
GUIDE = REPO / "docs" / "deploy.md"
FITTING = ["gke-a3-highgpu-8g", "eks-p5.48xlarge", "aks-nd96isr-h100-v5"]
NOT_FITTING = {
    # fixture: (the check that fails, what its line says)
    "gke-a3-highgpu-8g-boot-disk": (
        "ephemeral-storage",
        "pod requests 71Gi, node gke-trace-a3-h100-8d3b61c4-0 (and 1 more alike) has 43.8Gi "
        "allocatable: short by 27.2Gi",
    ),
    "aks-nd96asr-v4": ("memory", "has 897.8Gi allocatable: short by 638.2Gi"),
    "gke-a3-highgpu-4g": ("nvidia.com/gpu", "pod requests 8, node"),
    "eks-p5.48xlarge-driver-535": ("node-affinity", "nvidia.com/cuda.driver.major=535"),
    "aks-nd96isr-h100-v5-sku-taint": ("taints", "sku=gpu:NoSchedule, untolerated"),
}


def load(name: str) -> Any:
    return json.loads((NODES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def pods() -> check.Pods:
    return check.read_pods(check.render_overlay("kfp"), "kfp")


def qwen3_run() -> check.RunShape:
    return check.RunShape.of(check.run_parameters({}))


def failing(report: check.Report) -> dict[str, str]:
    return {m[1]: m[2] for text in report.lines if (m := re.fullmatch(r"FAIL (\S+): (.*)", text))}


@pytest.mark.parametrize("name", FITTING)
def test_the_node_shaped_pod_fits_the_big_clouds_h100_nodes(pods: check.Pods, name: str) -> None:
    report = check.check_cluster(fit.read_nodes(load(name), name), pods, qwen3_run())
    assert failing(report) == {}, report.lines
    assert report.fits and report.lines[-1] == "the run fits these nodes"
    assert "ok   nodes: 2 of 3 nodes fit the pod; the run needs 2" in report.lines
    assert "ok   maxReplicas: the gpu group may start 2 pods; the run needs 2" in report.lines
    # the two GPU nodes are alike: one line per check names both
    assert sum(" (and 1 more alike)" in text for text in report.lines) == 6


@pytest.mark.parametrize("name", NOT_FITTING)
def test_a_node_that_does_not_fit_is_named_with_the_resource(pods: check.Pods, name: str) -> None:
    report = check.check_cluster(fit.read_nodes(load(name), name), pods, qwen3_run())
    resource, says = NOT_FITTING[name]
    fails = failing(report)
    assert not report.fits and report.lines[-1] == "the run does not fit these nodes"
    assert says in fails[resource], fails
    assert "0 of 3 nodes fit the pod" in fails["nodes"]
    extra = {"memory"} if name == "gke-a3-highgpu-4g" else set()  # a4-4g: 936 GB as well
    assert set(fails) == {resource, "nodes", *extra}, fails


def test_a_gpu_node_without_gpu_feature_discovery_is_named(pods: check.Pods) -> None:
    """GKE's own driver install sets no GFD labels: the pod's affinity cannot see the driver."""
    data = load("gke-a3-highgpu-8g")
    for item in data["items"]:
        labels = item["metadata"]["labels"]
        item["metadata"]["labels"] = {k: v for k, v in labels.items() if "nvidia.com/" not in k}
    report = check.check_cluster(fit.read_nodes(data, "gke"), pods, qwen3_run())
    assert "no label nvidia.com/gpu.present, needs one of true" in failing(report)["node-affinity"]


def test_a_cluster_without_gpu_nodes_and_a_full_store(pods: check.Pods) -> None:
    data = load("gke-a3-highgpu-8g")
    data["items"] = data["items"][:1]  # the default pool only
    volume = check.read_store_volume(json.loads((NODES / "seaweedfs-pvc.json").read_text()), "p")
    report = check.check_cluster(fit.read_nodes(data, "gke"), pods, qwen3_run(), 8.19e9, volume)
    fails = failing(report)
    assert fails["nvidia.com/gpu"] == "pod requests 8, no node has nvidia.com/gpu allocatable"
    # KFP's SeaweedFS volume (20Gi) against the base model and 4 checkpoints of Qwen3-8B:
    # 8.19e9 × (2 + 4 × 14) = 475 GB = 442.4 GiB.
    assert fails["store"].startswith("volume seaweedfs-pvc holds 20Gi, the run keeps 442.4Gi")
    assert fails["store"].endswith("short by 422.4Gi")


def test_the_standalone_overlays_own_store_is_read() -> None:
    pods = check.read_pods(check.render_overlay("standalone"), "standalone")
    assert pods.store_volume == ("trace-store", Decimal(100 * 2**30))
    report = check.check_cluster(fit.read_nodes(load("eks-p5.48xlarge"), "eks"), pods, qwen3_run())
    assert failing(report).keys() == {"store"}


def test_pods_are_packed_by_what_each_actor_needs_on_one_pod() -> None:
    def run(engines: tuple[float, ...], trainers: int) -> check.RunShape:
        return check.RunShape(engines, trainers, "", 2)

    assert run((1.0,) * 8, 4).pods(8) == 2  # the Qwen3-8B run: 12 GPUs
    assert run((5.0,) * 3, 0).pods(8) == 3  # 15 GPUs, but no two 5-GPU engines share a pod
    assert run((4.0,) * 3, 3).pods(8) == 2  # [4, 4] and [4, 1, 1, 1]
    assert run((0.5,) * 4, 0).pods(8) == 1 and run((), 0).pods(8) == 0


def test_an_engine_wider_than_a_pod_is_named(pods: check.Pods) -> None:
    settings = {"train_workers": 1, "train_gpus": True}
    settings["engine"] = {"tensor_parallel": 16, "gpus_per_node": 16}  # type: ignore[assignment]
    params = check.run_parameters({"settings_json": json.dumps(settings)})
    run = check.RunShape.of(params)
    report = check.check_cluster(fit.read_nodes(load("eks-p5.48xlarge"), "e"), pods, run)
    assert failing(report)["engines"] == "an engine spans 16 GPUs; a pod has 8"


def test_quantities_are_read_as_kubernetes_writes_them() -> None:
    assert fit.quantity("207410m", "x") == Decimal("207.41")
    assert fit.quantity("98831908Ki", "x") == 98831908 * 1024
    assert fit.quantity("1536Gi", "x") == 1536 * 2**30
    assert fit.quantity("47060071478", "x") == 47060071478
    assert fit.quantity("1e3", "x") == 1000 and fit.quantity("2G", "x") == 2 * 10**9
    with pytest.raises(ValueError, match=r"node n, cpu: '12x' is not a Kubernetes quantity"):
        fit.quantity("12x", "node n, cpu")


def test_the_default_run_is_the_guides_qwen3_8b_set() -> None:
    (command,) = [c for c in commands(GUIDE.read_text()) if "--run-name qwen3-8b" in c]
    words = shlex.split(command)
    assignments = [words[i + 1] for i, word in enumerate(words) if word == "--param"]
    sent = build_params(read_package(DEFAULT_PACKAGE), assignments, "qwen3-8b-bfcl")
    fields = {f.name for f in dataclasses.fields(PipelineParameters)}
    guide = {k: v for k, v in sent.items() if k in fields and k != "run_name"}
    assert guide == check.QWEN3_8B_RUN
    assert check.RunShape.of(check.run_parameters({})).gpus == 8 * 1 + 4


# --- the command ---------------------------------------------------------------------------------


def invoke(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(app, ["cluster", "check", *args], input=stdin)


def test_the_exit_code_is_whether_the_run_fits() -> None:
    fits = invoke("--nodes", str(NODES / "aks-nd96isr-h100-v5.json"))
    assert fits.exit_code == 0, fits.output
    assert fits.output.splitlines()[-1] == "the run fits these nodes"
    short = invoke("--nodes", "-", stdin=(NODES / "gke-a3-highgpu-8g-boot-disk.json").read_text())
    assert short.exit_code == 1 and "FAIL ephemeral-storage: pod requests 71Gi" in short.output
    store = ["--store-pvc", str(NODES / "seaweedfs-pvc.json")]
    full = invoke("--nodes", str(NODES / "gke-a3-highgpu-8g.json"), *store)
    assert full.exit_code == 1 and "FAIL store: volume seaweedfs-pvc holds 20Gi" in full.output
    small = ["--param", "rollout_workers=4", "--parameters", "0.1"]
    fewer = invoke("--nodes", str(NODES / "gke-a3-highgpu-8g.json"), *small, *store)
    assert fewer.exit_code == 0, fewer.output  # 8 GPUs: one pod; 0.1 B parameters: 5.8 GB
    assert "run: 8 GPUs (4 engines × 1 GPU + 4 trainer GPUs): 1 pods of 8 GPUs" in fewer.output


NODE = '{"kind": "Node", "metadata": {"name": "n"}'
BAD_INPUT = {
    "missing": (["--nodes", "/nonexistent/n.json"], None, "--nodes /nonexistent/n.json: no such"),
    "not-json": (["--nodes", "-"], "{not json", "--nodes -: not JSON"),
    "not-nodes": (
        ["--nodes", "-"],
        '{"kind": "PodList", "items": [{"kind": "Pod"}]}',
        "--nodes -: not the JSON of `kubectl get nodes -o json`",
    ),
    "no-allocatable": (["--nodes", "-"], NODE + "}", "--nodes -: node n has no status.allocatable"),
    "bad-quantity": (
        ["--nodes", "-"],
        NODE + ', "status": {"allocatable": {"cpu": "lots"}}}',
        "--nodes -: node n, cpu: 'lots' is not a Kubernetes quantity",
    ),
    "param-form": (["--param", "budget"], None, "--param 'budget': expected KEY=VALUE"),
    "param-name": (["--param", "budgt=3"], None, "--param budgt: not a run parameter"),
    "param-type": (
        ["--param", "rollout_workers=x"],
        None,
        "rollout_workers=x: expected an integer",
    ),
    "overlay": (["--overlay", "prod"], None, "--overlay prod: no such overlay (has: dev, kfp,"),
    "no-gpu-group": (["--overlay", "dev"], None, "overlay dev: 0 GPU worker groups"),
    "not-a-pvc": (
        ["--store-pvc", str(NODES / "eks-p5.48xlarge.json")],
        None,
        "not the JSON of one PersistentVolumeClaim",
    ),
    "parameters": (["--parameters", "0"], None, "--parameters 0: expected a positive number"),
}
"""Each case's flags (with ``--nodes -`` and an empty node list on stdin unless it says
otherwise), its stdin, and what its error line says."""


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_error_line_and_exit_2(case: str) -> None:
    args, stdin, message = BAD_INPUT[case]
    if "--nodes" not in args:
        args, stdin = ["--nodes", "-", *args], '{"kind": "List", "items": []}'
    done = invoke(*args, stdin=stdin)
    assert done.exit_code == 2, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.output
    assert message in " ".join(done.output.split()), done.output


# --- as docs/deploy.md prints it ------------------------------------------------------------------

STAND_IN = """#!/bin/sh
# kubectl as a cluster with the nodes of $TRACE_NODES would answer `kubectl get nodes -o json`.
if [ "$*" = "get nodes -o json" ]; then exec cat "$TRACE_NODES"; fi
echo "stand-in kubectl: only get nodes -o json, not: $*" >&2
exit 3
"""


def run_as_printed(tmp_path: Path, nodes: str) -> subprocess.CompletedProcess[str]:
    """The guide's ``trace-rl cluster check`` command, as printed, in a fresh shell whose PATH
    has the venv's scripts and, first, a stand-in kubectl holding ``nodes``."""
    (command,) = [c for c in commands(GUIDE.read_text()) if c.startswith("trace-rl cluster check")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "kubectl").write_text(STAND_IN)
    (bin_dir / "kubectl").chmod(0o755)
    venv = Path(sys.executable).parent
    assert (venv / "trace-rl").is_file(), "the console script: make setup installs it"
    env = {
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "COLUMNS": "200",
        "PATH": os.pathsep.join([str(bin_dir), str(venv), os.environ["PATH"]]),
        "TRACE_NODES": str(NODES / f"{nodes}.json"),
    }
    return subprocess.run(
        command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a fresh trace-rl process and a kustomize build (≈10 s)
def test_the_guides_command_runs_as_printed(tmp_path: Path) -> None:
    done = run_as_printed(tmp_path, "gke-a3-highgpu-8g")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "the run fits these nodes"
    assert "ok   nodes: 2 of 3 nodes fit the pod; the run needs 2" in done.stdout
    short = run_as_printed(tmp_path, "eks-p5.48xlarge-driver-535")
    assert short.returncode == 1 and "FAIL node-affinity" in short.stdout, short.stdout


def test_the_fixtures_are_node_lists_as_kubectl_prints_them() -> None:
    for path in sorted(NODES.glob("*.json")):
        data = json.loads(path.read_text())
        if data["kind"] == "PersistentVolumeClaim":
            continue
        assert data["kind"] == "List" and data["apiVersion"] == "v1", path
        for item in data["items"]:
            assert item["kind"] == "Node" and item["metadata"]["labels"], path
            status = item["status"]
            assert status["capacity"].keys() == status["allocatable"].keys(), path
            for resource in ("cpu", "memory", "ephemeral-storage"):
                have = fit.quantity(status["allocatable"][resource], str(path))
                assert 0 < have <= fit.quantity(status["capacity"][resource], str(path))
