"""The Ray pods' sizes as the overlays render them, against the arithmetic written beside them in
manifests/base/raycluster.yaml:

- a ``gpu`` pod holds a whole 8-GPU node, and fits each of the three big clouds' 8 × H100 nodes
  beside the kubelet's reserve and the daemonsets;
- the ``gpu`` group may grow to the largest shape docs/deploy.md suggests for one run;
- its node-local disk fits a 128 GiB OS disk, and its scratch claim holds eight trainer ranks'
  scratch at 8B;
- every pod's ephemeral-storage covers its disk emptyDirs (the ones KubeRay adds included) and
  its containers' own writable layers and logs, so the kubelet schedules by what they may write;
- no PodDisruptionBudget holds a drain of a Ray pod's node (the head's was maxUnavailable 0;
  docs/deploy.md, section 10, says what a drain during a run costs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support import render
from support.netpol import selects

from trace_core.policy.memory import QWEN3

GIB = 2**30
NODES = {
    "GKE a3-highgpu-8g": (208, 1_872 * 10**9),
    "AWS p5.48xlarge": (192, 2_048 * GIB),
    "Azure ND96isr H100 v5": (96, 1_900 * GIB),
}
"""vCPUs and memory of the 8 × H100 80 GB machines of the three big clouds (their published
machine tables)."""
NODE_GPUS = 8
DAEMONSETS = 32 * GIB
DAEMONSET_CPUS = 4
"""The node's daemonsets: the GPU operator's (driver, toolkit, device plugin, GFD, DCGM exporter,
validator), CNI, CSI, kube-proxy, log and metrics agents."""
EVICTION_THRESHOLD = 100 * 2**20
KUBELET_CPUS = 1.0
"""CPUs a node keeps from its pods: GKE's and EKS's rate (6% of the first core, 1% of the
second, 0.5% of the next two, 0.25% of the rest) keeps 0.31 of 96 and 0.59 of 208; AKS's older
table about 1."""
LARGEST_RUN = 8 + 4
"""docs/deploy.md's 8B shape at its largest: 8 engines of one GPU and FSDP over 4 trainer GPUs."""
OS_DISK_ALLOCATABLE = 119_703_055_367
"""The ephemeral-storage an AKS node with its default 128 GiB OS disk reports allocatable
(capacity 129,886,128 Ki less the 10% eviction threshold)."""
WRITABLE_LAYER = GIB
"""Each container's own writable layer and logs (the kubelet keeps 5 log files of 10 Mi)."""
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str | int) -> int:
    """Bytes (or units) of a Kubernetes quantity (``16Gi``, ``512Mi``, ``1000``)."""
    text = str(text)
    for suffix, scale in UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def kubelet_reserve(memory: int) -> int:
    """Memory a node keeps from its pods at GKE's rate, the largest of the three big clouds' at
    this size: 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8, 6% of the next 112,
    2% of the rest, and the eviction threshold."""
    tiers = [(4 * GIB, 0.25), (4 * GIB, 0.20), (8 * GIB, 0.10), (112 * GIB, 0.06)]
    reserved, left = 0.0, memory
    for size, rate in tiers:
        reserved += min(left, size) * rate
        left -= min(left, size)
    return int(reserved + left * 0.02) + EVICTION_THRESHOLD


def cluster_of(built: render.Builds, overlay: str) -> dict[str, Any]:
    (cluster,) = [o for o in built[overlay] if o["kind"] == "RayCluster"]
    return cluster


def group(cluster: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == name]
    return found


def limits(group_spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = group_spec["template"]["spec"]["containers"]
    resources = container["resources"]
    assert resources["requests"] == resources["limits"], "requests differ from limits"
    return resources["limits"]


def test_the_reserve_is_gkes_arithmetic() -> None:
    # a3-highgpu-8g, 1,872 GB = 1,743.4 GiB: 1 + 0.8 + 0.8 + 6.72 + 2% of (1,743.4 − 128) GiB
    # = 41.6 GiB, + 0.1 GiB.
    assert round(kubelet_reserve(NODES["GKE a3-highgpu-8g"][1]) / GIB, 1) == 41.7


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
@pytest.mark.parametrize("node", NODES)
def test_a_gpu_pod_fits_an_8_gpu_node_alone(built: render.Builds, overlay: str, node: str) -> None:
    cpus, memory = NODES[node]
    bound = limits(group(cluster_of(built, overlay), "gpu"))
    assert int(bound["nvidia.com/gpu"]) == NODE_GPUS  # the whole node: one pod per node
    room = memory - kubelet_reserve(memory) - DAEMONSETS
    assert quantity(bound["memory"]) <= room, (
        f"{overlay}: a gpu pod ({bound['memory']}) is more than the {room / GIB:.0f} GiB {node} "
        "leaves its pods"
    )
    cpu_room = cpus - KUBELET_CPUS - DAEMONSET_CPUS
    assert float(bound["cpu"]) <= cpu_room, f"{overlay}: cpu {bound['cpu']} > {cpu_room} on {node}"


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
def test_the_gpu_group_admits_the_largest_suggested_run(built: render.Builds, overlay: str) -> None:
    gpu = group(cluster_of(built, overlay), "gpu")
    assert gpu["maxReplicas"] * int(limits(gpu)["nvidia.com/gpu"]) >= LARGEST_RUN


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
def test_the_gpu_pods_disk_fits_an_os_disk_and_its_claim_the_trainers(
    built: render.Builds, overlay: str
) -> None:
    """The node-local part (ephemeral-storage) fits AKS's default OS disk; the trainers' scratch
    is a claim of its own (a generic ephemeral volume) that holds eight ranks at 8B: each rank's
    start state (policy 2, master 4, reference 2, AdamW 8 bytes a parameter) and rank 0's
    checkpoint on its way to S3 (14), beside 20 GB of Ray's session folder."""
    gpu = group(cluster_of(built, overlay), "gpu")
    assert quantity(limits(gpu)["ephemeral-storage"]) <= OS_DISK_ALLOCATABLE
    spec = gpu["template"]["spec"]
    (container,) = spec["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    (scratch,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    claim = scratch["ephemeral"]["volumeClaimTemplate"]["spec"]
    needed = (8 * 16 + 14) * QWEN3["8B"].parameters + 20 * 10**9
    assert quantity(claim["resources"]["requests"]["storage"]) >= needed
    assert "storageClassName" not in claim  # the cluster's default class, unless a patch says


def disk_problems(spec: dict[str, Any], source: str) -> list[str]:
    """Why a pod's ephemeral-storage does not cover its disk emptyDirs and containers."""
    problems = []
    mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    scratch = 0
    for volume in spec.get("volumes", []):
        empty_dir = volume.get("emptyDir")
        if empty_dir is None or empty_dir.get("medium") == "Memory":
            continue
        if "sizeLimit" not in empty_dir:
            problems.append(f"{source}: emptyDir {volume['name']} has no sizeLimit")
            continue
        if volume["name"] in mounted:
            scratch += quantity(empty_dir["sizeLimit"])
    requested = 0
    for container in spec["containers"]:
        resources = container.get("resources") or {}
        request = (resources.get("requests") or {}).get("ephemeral-storage")
        limit = (resources.get("limits") or {}).get("ephemeral-storage")
        if request is None or request != limit:
            problems.append(f"{source}, {container['name']}: ephemeral-storage {request}/{limit}")
            continue
        requested += quantity(request)
    needed = scratch + WRITABLE_LAYER * len(spec["containers"])
    if not problems and requested < needed:
        problems.append(
            f"{source}: ephemeral-storage {requested / GIB:.0f} GiB < the emptyDirs' "
            f"{scratch / GIB:.0f} GiB + 1 GiB per container = {needed / GIB:.0f} GiB"
        )
    return problems


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_ephemeral_storage_covers_every_scratch_volume(
    built: render.Builds, ray_pods: Callable[..., Any], overlay: str
) -> None:
    pods = [(p.source, p.spec) for p in ray_pods(cluster_of(built, overlay))]
    pods += [
        (t.source, t.spec)
        for o in built[overlay]
        if o["kind"] in render.WORKLOAD_KINDS
        for t in render.pod_templates(o)
    ]
    assert len(pods) >= 2
    problems = [line for source, spec in pods for line in disk_problems(spec, source)]
    assert problems == []


def test_an_unsized_or_uncovered_volume_is_named() -> None:
    spec = {
        "containers": [
            {
                "name": "c",
                "volumeMounts": [{"name": "a"}, {"name": "b"}],
                "resources": {
                    "requests": {"ephemeral-storage": "3Gi"},
                    "limits": {"ephemeral-storage": "3Gi"},
                },
            }
        ],
        "volumes": [
            {"name": "a", "emptyDir": {"sizeLimit": "3Gi"}},
            {"name": "b", "emptyDir": {"medium": "Memory"}},
        ],
    }
    assert disk_problems(spec, "p") == [
        "p: ephemeral-storage 3 GiB < the emptyDirs' 3 GiB + 1 GiB per container = 4 GiB"
    ]
    spec["volumes"].append({"name": "c", "emptyDir": {}})
    assert "p: emptyDir c has no sizeLimit" in disk_problems(spec, "p")


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_no_disruption_budget_holds_a_drain(
    built: render.Builds, ray_pods: Callable[..., Any], overlay: str
) -> None:
    """A drain or a node upgrade may evict any Ray pod: no PodDisruptionBudget allows none of
    the pods it selects to go (maxUnavailable 0, minAvailable 100%, or minAvailable 1 of the one
    head), which would hold the drain until someone deleted the pod by hand. A drain during a
    run loses the run's session; the run resumes from its newest checkpoint."""
    for budget in [o for o in built[overlay] if o["kind"] == "PodDisruptionBudget"]:
        spec = budget["spec"]
        chosen = [
            p for p in ray_pods(cluster_of(built, overlay)) if selects(spec["selector"], p.labels)
        ]
        assert str(spec.get("maxUnavailable")) not in ("0", "0%"), spec
        assert str(spec.get("minAvailable")) != "100%", spec
        if [p.group for p in chosen] == ["headgroup"]:
            assert not spec.get("minAvailable"), spec
