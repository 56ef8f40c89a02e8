"""Whether a cluster's nodes hold a run, before the run: ``trace-rl cluster check``.

    nodes = node_fit.read_nodes(json.loads(text), "--nodes nodes.json")   # a ValueError names it
    pods = read_pods(render_overlay("kfp"), "kfp")            # kubectl kustomize, offline
    report = check_cluster(nodes, pods, RunShape.of(run_parameters({})))  # Qwen3-8B
    print("\\n".join(report.lines)); exit(0 if report.fits else 1)

What it compares, all of it read from the rendered overlay (``manifests/overlays/<name>``) and
the nodes' JSON (``kubectl get nodes -o json``), none of it restated here:

- the RayCluster's GPU worker pod (its group holds a node's GPUs: one pod per node) against each
  GPU node's allocatable ``nvidia.com/gpu``, CPU, memory and ephemeral-storage, its node
  affinity (the NVIDIA driver label the GPU image needs) and the node's taints;
- how many nodes fit it against the pods the run needs: its engines' GPUs (``rollout_workers``
  × ``gpus_per_worker``, or ``tensor_parallel`` GPUs on one pod) and its trainers' (one each with
  ``train_gpus``), packed into pods; and the group's ``maxReplicas``;
- the head pod (its Ray container and the autoscaler sidecar) against every node;
- the store's volume against what the run keeps there (the base model and ``keep_checkpoints``
  + 2 checkpoints at the peak, docs/deploy.md "The store a run needs"), where the volume can be
  read: a PersistentVolumeClaim's JSON, or the store the overlay itself deploys.

Allocatable is what the kubelet offers pods, before the daemonsets and the pods already on a
node; a node pool a cluster autoscaler holds at zero nodes is not in ``kubectl get nodes``. Every
line is ``ok``, ``FAIL`` or ``skip`` and names what it compared, by how much it falls short.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from pipelines.node_fit import GPU, RESOURCES, Node, PodShape, node_lines, quantity, show
from trace_core.policy.memory import QWEN3
from trace_core.train.contract import PipelineParameters

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
CHECKPOINT_BYTES = 2 + 8 + 4
"""A checkpoint per parameter: the bf16 policy, AdamW's two fp32 moments, the fp32 master."""
MODEL_BYTES = 2
"""The base model per parameter, in bf16 (Qwen3's serving dtype)."""
QWEN3_8B_RUN = {
    "task": "bfcl",
    "base_model_uri": "s3://mlpipeline/shared/trace-rl/models/Qwen3-8B",
    "engine": "vllm",
    "rollout_workers": 8,
    "gpus_per_worker": 1.0,
    "ray_jobs_url": "http://trace-rl-head-svc.trace-rl.svc.cluster.local:8265",
    "store_uri": "s3://mlpipeline/shared/trace-rl",
    "settings_json": (
        '{"train_workers": 4, "train_gpus": true, "train_fsdp": true, '
        '"update": {"checkpointing": true}}'
    ),
}
"""The run docs/deploy.md spells out ("One complete parameter set: Qwen3-8B"), as the run
parameters it sets (tests/pipelines/test_cluster_check.py checks the two agree)."""
QWEN3_8B_PARAMETERS = QWEN3["8B"].parameters


@dataclass(frozen=True)
class Pods:
    """The RayCluster's GPU worker pod and group, and its head pod."""

    worker: PodShape
    group: str
    max_replicas: int
    scratch: tuple[str, ...]
    """The worker's claims (generic ephemeral volumes), which nodes do not show."""
    head: PodShape
    store_volume: tuple[str, Decimal] | None
    """The store the overlay deploys (its PVC's name and request), if any."""


def read_pods(objects: list[dict[str, Any]], overlay: str) -> Pods:
    clusters = [o for o in objects if o.get("kind") == "RayCluster"]
    if len(clusters) != 1:
        raise ValueError(f"overlay {overlay}: {len(clusters)} RayClusters, expected one")
    spec = clusters[0]["spec"]
    groups = []
    for group in spec.get("workerGroupSpecs") or []:
        pod = group["template"]["spec"]
        source = f"overlay {overlay}, RayCluster worker group {group['groupName']}"
        shape = PodShape.of(source, pod, [])
        if shape.requests[GPU] > 0:
            claims = tuple(
                f"{c['resources']['requests']['storage']} (volume {v['name']})"
                for v in pod.get("volumes", [])
                if (c := (v.get("ephemeral") or {}).get("volumeClaimTemplate", {}).get("spec"))
            )
            groups.append((group, shape, claims))
    if len(groups) != 1:
        raise ValueError(
            f"overlay {overlay}: {len(groups)} GPU worker groups, expected one (the dev overlay "
            "has none: check kfp or standalone)"
        )
    ((group, worker, claims),) = groups
    autoscaler = (
        spec.get("autoscalerOptions") or {} if spec.get("enableInTreeAutoscaling") else None
    )
    sidecar = [{"resources": autoscaler.get("resources") or {}}] if autoscaler is not None else []
    head = PodShape.of(
        f"overlay {overlay}, RayCluster head", spec["headGroupSpec"]["template"]["spec"], sidecar
    )
    stores = [
        (o["metadata"]["name"], quantity(o["spec"]["resources"]["requests"]["storage"], overlay))
        for o in objects
        if o.get("kind") == "PersistentVolumeClaim"
    ]
    store = stores[0] if len(stores) == 1 else None
    return Pods(worker, group["groupName"], int(group["maxReplicas"]), claims, head, store)


@dataclass(frozen=True)
class RunShape:
    """The GPUs a run's actors ask Ray for, and what it keeps in the store."""

    engines: tuple[float, ...]
    """GPUs each engine reserves on one pod."""
    trainers: int
    """Trainer ranks of one GPU each."""
    what: str
    keep_checkpoints: int

    @classmethod
    def of(cls, params: PipelineParameters) -> RunShape:
        config = params.config()
        engine, train = config.train.engine, config.train
        each = engine.engine_gpus
        trainers = train.train_workers if train.train_gpus else 0
        what = f"{engine.workers} engines × {each:g} GPU + {trainers} trainer GPUs"
        return cls((each,) * engine.workers, trainers, what, params.keep_checkpoints)

    @property
    def gpus(self) -> float:
        return sum(self.engines) + self.trainers

    def pods(self, per_pod: int) -> int:
        """Pods of ``per_pod`` GPUs the actors need: each engine's GPUs on one pod, packed
        first-fit, largest first, as Ray's placement groups can place them at best."""
        free: list[float] = []
        for size in sorted([*self.engines, *[1.0] * self.trainers], reverse=True):
            if size <= 0:
                continue
            fit = next((i for i, room in enumerate(free) if room >= size - 1e-9), None)
            if fit is None:
                free.append(per_pod - size)
            else:
                free[fit] -= size
        return len(free)


WORDS = {int: "an integer", float: "a number"}


def run_parameters(overrides: dict[str, str]) -> PipelineParameters:
    """The Qwen3-8B run with ``overrides`` (run parameter → text), each typed by its field."""
    fields = {f.name: f for f in dataclasses.fields(PipelineParameters)}
    values: dict[str, object] = dict(QWEN3_8B_RUN)
    for key, text in overrides.items():
        if key not in fields:
            raise ValueError(f"--param {key}: not a run parameter (has: {', '.join(fields)})")
        kind = type(fields[key].default)
        try:
            values[key] = kind(text) if kind in (int, float) else text
        except ValueError:
            raise ValueError(f"--param {key}={text}: expected {WORDS[kind]}") from None
    return PipelineParameters(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Report:
    lines: list[str]
    fits: bool


def line(ok: bool | None, check: str, detail: str) -> str:
    status = "skip" if ok is None else "ok" if ok else "FAIL"
    return f"{status:<4} {check}: {detail}"


def requested(pod: PodShape) -> str:
    return ", ".join(f"{show(r, pod.requests[r])} {r}" for r in RESOURCES if pod.requests[r])


def worker_lines(nodes: list[Node], pods: Pods, needed: int) -> tuple[list[str], bool]:
    """The worker pod against each GPU node (nodes alike share a line), how many fit it against
    the pods the run needs, and the group's maxReplicas; and whether all of that holds."""
    out: list[str] = []
    shared: dict[tuple[bool, str, str], list[str]] = {}
    fitting = 0
    gpu_nodes = [n for n in nodes if n.allocatable[GPU] > 0]
    for node in gpu_nodes:
        results = node_lines(pods.worker, node)
        fitting += all(ok for ok, _, _ in results)
        for ok, check, detail in results:
            key = (ok, check, detail.replace(f"node {node.name}", "node {}", 1))
            shared.setdefault(key, []).append(node.name)
    for (ok, check, detail), names in shared.items():
        alike = f"{names[0]} (and {len(names) - 1} more alike)" if len(names) > 1 else names[0]
        out.append(line(ok, check, detail.replace("node {}", f"node {alike}", 1)))
    if not gpu_nodes:
        asked = show(GPU, pods.worker.requests[GPU])
        out.append(line(False, GPU, f"pod requests {asked}, no node has {GPU} allocatable"))
    enough = fitting >= needed
    out.append(
        line(
            enough, "nodes", f"{fitting} of {len(nodes)} nodes fit the pod; the run needs {needed}"
        )
    )
    room = pods.max_replicas >= needed
    group = f"the {pods.group} group may start {pods.max_replicas} pods; the run needs {needed}"
    out.append(line(room, "maxReplicas", group))
    return out, enough and room


def head_line(nodes: list[Node], pods: Pods) -> tuple[str, bool]:
    """Whether any node holds the head pod (its Ray container and the autoscaler sidecar)."""
    asked = f"pod requests {requested(pods.head)}"
    reasons = []
    for node in nodes:
        misses = [detail for ok, _, detail in node_lines(pods.head, node) if not ok]
        if not misses:
            return line(True, "head", f"{asked}; node {node.name} fits it"), True
        reasons.append(misses[0])
    shown = "; ".join(reasons[:3]) or "no nodes"
    return line(False, "head", f"{asked}; no node fits it: {shown}"), False


def store_line(
    volume: tuple[str, Decimal] | None, run: RunShape, parameters: float
) -> tuple[str, bool]:
    """The store's volume against the base model and the checkpoints the run keeps at most."""
    keep = run.keep_checkpoints + 2
    need = Decimal(parameters) * (MODEL_BYTES + keep * CHECKPOINT_BYTES)
    what = (
        f"the run keeps {show('memory', need)}, the base model ({MODEL_BYTES} bytes a "
        f"parameter) and {keep} checkpoints (keep_checkpoints {run.keep_checkpoints} + 2 at the "
        f"peak, {CHECKPOINT_BYTES} bytes a parameter) of {parameters / 1e9:.2f} B parameters"
    )
    if volume is None:
        where = "pass --store-pvc FILE (`kubectl -n kubeflow get pvc seaweedfs-pvc -o json`)"
        return line(None, "store", f"could not read the store's volume: {where}; {what}"), True
    name, size = volume
    text = f"volume {name} holds {show('memory', size)}, {what}"
    if size >= need:
        return line(True, "store", text), True
    return line(False, "store", f"{text}: short by {show('memory', need - size)}"), False


def check_cluster(
    nodes: list[Node],
    pods: Pods,
    run: RunShape,
    parameters: float = QWEN3_8B_PARAMETERS,
    store_volume: tuple[str, Decimal] | None = None,
) -> Report:
    """Every check of the module docstring, one line each; ``store_volume`` (a claim's name and
    size) stands in for the overlay's own store."""
    per_pod = int(pods.worker.requests[GPU])
    needed = run.pods(per_pod)
    out = [
        f"pod: {pods.worker.source}: {requested(pods.worker)}",
        f"run: {run.gpus:g} GPUs ({run.what}): {needed} pods of {per_pod} GPUs",
    ]
    fits = True
    widest = max(run.engines, default=0.0)
    if widest > per_pod:
        out.append(line(False, "engines", f"an engine spans {widest:g} GPUs; a pod has {per_pod}"))
        fits = False
    lines, ok = worker_lines(nodes, pods, needed)
    out += lines
    fits &= ok
    text, ok = head_line(nodes, pods)
    out.append(text)
    fits &= ok
    for claim in pods.scratch:
        out.append(
            line(
                None,
                "scratch",
                f"each {pods.group} pod claims {claim} of the default StorageClass, which nodes "
                "do not show (`kubectl get storageclass` names the default)",
            )
        )
    text, ok = store_line(store_volume or pods.store_volume, run, parameters)
    out.append(text)
    fits &= ok
    out.append(f"the run {'fits' if fits else 'does not fit'} these nodes")
    return Report(out, fits)


def read_store_volume(data: object, source: str) -> tuple[str, Decimal]:
    """A PersistentVolumeClaim's name and size (its bound capacity, else its request)."""
    if isinstance(data, dict) and data.get("kind") == "List" and len(data.get("items") or []) == 1:
        data = data["items"][0]
    if not isinstance(data, dict) or data.get("kind") != "PersistentVolumeClaim":
        raise ValueError(
            f"{source}: not the JSON of one PersistentVolumeClaim (`kubectl get pvc NAME -o json`)"
        )
    capacity = ((data.get("status") or {}).get("capacity") or {}).get("storage")
    request = (((data.get("spec") or {}).get("resources") or {}).get("requests") or {}).get(
        "storage"
    )
    if capacity is None and request is None:
        raise ValueError(f"{source}: the claim has neither status.capacity nor a storage request")
    name = str((data.get("metadata") or {}).get("name", "?"))
    return name, quantity(capacity if capacity is not None else request, source)


def kubectl(pinned_first: bool) -> str:
    """The venv's kubectl (the pinned one the tests build with) or the one on PATH, in the
    order asked: kustomize builds prefer the pinned one, cluster reads the user's own."""
    beside = Path(sys.executable).parent / "kubectl"
    found = shutil.which("kubectl")
    order = [str(beside) if beside.is_file() else None, found]
    for candidate in order if pinned_first else order[::-1]:
        if candidate:
            return candidate
    raise FileNotFoundError("kubectl is not installed: `make setup` installs it into .venv")


def render_overlay(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize manifests/overlays/<overlay>`` on a scratch copy of manifests/ whose
    Secret env files are made from the tracked examples: no credential is read."""
    overlays = sorted(p.name for p in (MANIFESTS / "overlays").iterdir() if p.is_dir())
    if overlay not in overlays:
        raise ValueError(f"--overlay {overlay}: no such overlay (has: {', '.join(overlays)})")
    with tempfile.TemporaryDirectory(prefix="trace-cluster-check-") as scratch:
        root = Path(scratch) / "manifests"
        shutil.copytree(MANIFESTS, root, ignore=shutil.ignore_patterns("*.env"))
        for example in root.rglob("*.env.example"):
            shutil.copyfile(example, example.with_suffix(""))
        command = [kubectl(pinned_first=True), "kustomize", str(root / "overlays" / overlay)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise ValueError(f"kubectl kustomize of overlay {overlay} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def get_nodes() -> object:
    """``kubectl get nodes -o json`` of the current context."""
    command = [kubectl(pinned_first=False), "get", "nodes", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"kubectl get nodes -o json failed ({why}): pass --nodes FILE instead")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise ValueError(f"kubectl get nodes -o json printed no JSON ({err})") from None
