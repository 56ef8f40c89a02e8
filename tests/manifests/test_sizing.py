"""The Ray pods' sizes as the overlays render them, against the arithmetic written beside them in
manifests/base/raycluster.yaml:

- eight ``gpu`` pods (one GPU each) fit an 8-GPU node of 1.5 TB beside the kubelet's reserve and
  the daemonsets, and a ``gpu-tp`` pod (eight GPUs) fits it alone;
- the ``gpu`` group may grow to the largest shape docs/deploy.md suggests for one run;
- every pod's ephemeral-storage covers its disk emptyDirs (the ones KubeRay adds included) and
  its containers' own writable layers and logs, so the kubelet schedules by what they may write;
- the head has a PodDisruptionBudget that selects it, by KubeRay's labels, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support import render

GIB = 2**30
NODE_MEMORY = 1_500 * 10**9
"""An 8-GPU node of 1.5 TB (1,397 GiB); GCP's a3-highgpu-8g has 1,872 GB."""
DAEMONSETS = 32 * GIB
"""The node's daemonsets: the GPU operator's (driver, toolkit, device plugin, GFD, DCGM exporter,
validator), CNI, kube-proxy, log and metrics agents."""
EVICTION_THRESHOLD = 100 * 2**20
LARGEST_RUN = 8 + 4
"""docs/deploy.md's 8B shape at its largest: 8 engines of one GPU and FSDP over 4 trainer GPUs."""
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
    # 1 + 0.8 + 0.8 + 6.72 + 2% of (1,397.0 − 128) GiB = 34.7 GiB, + 0.1 GiB.
    assert round(kubelet_reserve(NODE_MEMORY) / GIB, 1) == 34.8


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
def test_gpu_pods_fit_a_node_of_one_and_a_half_terabytes(
    built: render.Builds, overlay: str
) -> None:
    cluster = cluster_of(built, overlay)
    room = NODE_MEMORY - kubelet_reserve(NODE_MEMORY) - DAEMONSETS
    for name in ("gpu", "gpu-tp"):
        bound = limits(group(cluster, name))
        per_node = 8 // int(bound["nvidia.com/gpu"])
        used = per_node * quantity(bound["memory"])
        assert used <= room, (
            f"{overlay}: {per_node} × {name} pod ({bound['memory']}) = {used / GIB:.0f} GiB, "
            f"more than the {room / GIB:.0f} GiB a 1.5 TB node leaves its pods"
        )


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
def test_the_gpu_group_admits_the_largest_suggested_run(built: render.Builds, overlay: str) -> None:
    assert group(cluster_of(built, overlay), "gpu")["maxReplicas"] >= LARGEST_RUN


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
def test_the_head_has_a_disruption_budget(
    built: render.Builds, ray_pods: Callable[..., Any], overlay: str
) -> None:
    """Voluntary evictions (drains, upgrades) spare the running head: no pod of it may go."""
    (budget,) = [o for o in built[overlay] if o["kind"] == "PodDisruptionBudget"]
    spec = budget["spec"]
    assert spec.get("maxUnavailable") == 0 or spec.get("minAvailable") == 1, spec
    assert spec["selector"].keys() == {"matchLabels"}
    wanted = spec["selector"]["matchLabels"].items()
    chosen = [p.group for p in ray_pods(cluster_of(built, overlay)) if wanted <= p.labels.items()]
    assert chosen == ["headgroup"]
