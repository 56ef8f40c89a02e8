"""Fixtures of the manifest checks: every overlay built once per session, the upstream schemas,
and the pods KubeRay makes of a RayCluster.

The builds come from ``tests/support/render.py`` (also run by ``make scan``): a scratch copy of
manifests/ whose Secret env files are the tracked examples, built by ``kubectl kustomize``.
"""

from __future__ import annotations

import copy
import gzip
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import render

SCHEMAS = render.REPO.parent / "shared" / "schemas"


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Overlay name (and "base") → the objects ``kubectl kustomize`` builds (``render.Builds``)."""
    return render.build_all(tmp_path_factory.mktemp("manifests"))


VENDORED = render.REPO / "tests" / "schemas"


@pytest.fixture(scope="session")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The upstream CRD schemas: shared/schemas beside the repository when it has every folder
    of tests/schemas, else the gzipped copies there (same bytes; see its README)."""
    folders = [p.name for p in VENDORED.iterdir() if p.is_dir()]
    if all((SCHEMAS / folder).is_dir() for folder in folders):
        return SCHEMAS
    out = tmp_path_factory.mktemp("schemas")
    for packed in VENDORED.rglob("*.gz"):
        target = out / packed.relative_to(VENDORED).with_suffix("")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(gzip.decompress(packed.read_bytes()))
    return out


METRICS_PORT = ("metrics", 8080)
"""The name and number of the Ray container's metrics port as KubeRay v1.6.0 adds it
(``utils.MetricsPortName``, ``utils.DefaultMetricsPort``)."""


@dataclass(frozen=True)
class RayPod:
    """A pod KubeRay makes of one group of a RayCluster."""

    source: str  # e.g. "RayCluster trace-rl/trace-rl, worker group gpu"
    group: str  # "headgroup" for the head
    labels: dict[str, str]
    spec: dict[str, Any]


def kuberay_pods(cluster: dict[str, Any]) -> list[RayPod]:
    """The head's and each worker group's pod as KubeRay v1.6.0 makes them, as far as these checks
    need (ray-operator/controllers/ray/common/pod.go): the labels of ``labelPod`` over the
    template's (ray.io/cluster, node-type and group cannot be overridden), and in the head, with
    in-tree autoscaling, the ``autoscaler`` sidecar (``BuildAutoscalerContainer``: the head's
    image; ``mergeAutoscalerOverrides``: autoscalerOptions' resources, image, env, volumeMounts
    and securityContext), the emptyDirs ``BuildPod`` adds where a container mounts nothing at
    their path (``addEmptyDir``): /dev/shm in the Ray container, in memory, sized at its memory
    limit; /tmp/ray in the head's Ray container and sidecar, on disk, with no size limit; and
    the Ray container's port ``metrics`` (``DefaultHeadPodTemplate``, ``DefaultWorkerPodTemplate``:
    ``DefaultMetricsPort`` 8080, where it declares no port of that name), on which every node's
    Ray serves its metrics (``generateRayStartCommand``: --metrics-export-port=8080 unless
    rayStartParams set it)."""
    name = cluster["metadata"]["name"]
    spec = cluster["spec"]
    groups = [("head", "headgroup", spec["headGroupSpec"]["template"])]
    groups += [("worker", g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    pods = []
    for node_type, group, template in groups:
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        labels |= {
            "ray.io/is-ray-node": "yes",
            "ray.io/cluster": name,
            "ray.io/node-type": node_type,
            "ray.io/group": group,
            "ray.io/identifier": f"{name}-{node_type}",
            "app.kubernetes.io/name": "kuberay",
            "app.kubernetes.io/created-by": "kuberay-operator",
        }
        pod_spec = copy.deepcopy(template["spec"])
        if node_type == "head" and spec.get("enableInTreeAutoscaling"):
            options = spec.get("autoscalerOptions") or {}
            sidecar = {"name": "autoscaler", "image": pod_spec["containers"][0]["image"]}
            for key in ("resources", "image", "env", "volumeMounts", "securityContext"):
                if key in options:
                    sidecar[key] = copy.deepcopy(options[key])
            pod_spec["containers"].append(sidecar)
            for container in pod_spec["containers"]:
                add_empty_dir(pod_spec, container, "ray-logs", "/tmp/ray", {})
        ray = pod_spec["containers"][0]
        if not any(p.get("name") == METRICS_PORT[0] for p in ray.get("ports", [])):
            ray.setdefault("ports", []).append(
                {"name": METRICS_PORT[0], "containerPort": METRICS_PORT[1]}
            )
        memory = ray.get("resources", {}).get("limits", {}).get("memory")
        shm = {"medium": "Memory", **({"sizeLimit": memory} if memory else {})}
        add_empty_dir(pod_spec, ray, "shared-mem", "/dev/shm", shm)
        where = "head" if node_type == "head" else f"worker group {group}"
        source = f"RayCluster {cluster['metadata'].get('namespace')}/{name}, {where}"
        pods.append(RayPod(source, group, labels, pod_spec))
    return pods


def add_empty_dir(
    spec: dict[str, Any], container: dict[str, Any], name: str, path: str, empty_dir: dict[str, Any]
) -> None:
    """KubeRay's ``addEmptyDir``: nothing when ``container`` mounts something at ``path``; else
    the volume ``name`` (added to the pod when it has none of that name) mounted there."""
    mounts = container.setdefault("volumeMounts", [])
    if any(m["mountPath"] == path for m in mounts):
        return
    volumes = spec.setdefault("volumes", [])
    if not any(v["name"] == name for v in volumes):
        volumes.append({"name": name, "emptyDir": dict(empty_dir)})
    mounts.append({"name": name, "mountPath": path})


@pytest.fixture(scope="session")
def ray_pods() -> Callable[[dict[str, Any]], list[RayPod]]:
    """``kuberay_pods``: a RayCluster's pods as KubeRay makes them."""
    return kuberay_pods
