"""Prometheus reaches the Ray pods' metrics, and no one else does:

- the PodMonitor of manifests/monitoring (an optional component: no overlay has it by default,
  since its kind needs the Prometheus Operator's CRD) selects every Ray pod of the overlay, and
  only those, on the port KubeRay v1.6.0 gives their Ray container (``metrics``, 8080, the port
  it starts Ray with: ``--metrics-export-port``), which no group's rayStartParams moves;
- the network policies admit the ``monitoring`` namespace to that port of every Ray pod, and to
  no other port; a pod of another namespace, or a pod of trace-rl that is not Ray's, gets none of
  it (Ray 2.60 serves its metrics without its token auth).

Its schema is checked in test_build.py (the Prometheus Operator's CRD, vendored in
tests/schemas). KubeRay's pods are ``kuberay_pods`` (conftest.py), with the port it adds.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import render
from support.netpol import admits, namespace_labels, selects

Manifest = dict[str, Any]
PROMETHEUS = (
    "monitoring",
    namespace_labels("monitoring"),
    {"app.kubernetes.io/name": "prometheus"},
)
"""A Prometheus pod of kube-prometheus-stack: its namespace, the namespace's labels, its labels."""


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    """Each overlay built with manifests/monitoring added."""
    return {
        overlay: render.build_with(tmp_path_factory.mktemp(overlay), overlay, "monitoring")
        for overlay in render.OVERLAYS
    }


def the(objects: list[Manifest], kind: str) -> Manifest:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_no_overlay_has_the_pod_monitor_by_default(built: render.Builds, overlay: str) -> None:
    """`kubectl apply -k` of an overlay must not need the Prometheus Operator's CRD."""
    assert not [o for o in built[overlay] if o["kind"] == "PodMonitor"]


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_the_pod_monitor_scrapes_every_ray_pod_on_its_metrics_port(
    monitored: dict[str, list[Manifest]], ray_pods: Callable[..., Any], overlay: str
) -> None:
    objects = monitored[overlay]
    monitor, cluster = the(objects, "PodMonitor"), the(objects, "RayCluster")
    assert monitor["metadata"]["namespace"] == cluster["metadata"]["namespace"] == "trace-rl"
    assert "namespaceSelector" not in monitor["spec"]  # its own namespace
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    pods = ray_pods(cluster)
    assert {p.group for p in pods} >= {"headgroup"} and len(pods) >= 2
    for pod in pods:
        assert selects(monitor["spec"]["selector"], pod.labels), pod.source
        ray = pod.spec["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in ray["ports"] if "name" in p}
        assert ports.get(endpoint["port"]) == 8080, (pod.source, ports)
    spec = cluster["spec"]
    for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
        # KubeRay starts Ray on this port unless rayStartParams say otherwise; its port
        # `metrics` stays 8080 either way.
        assert group["rayStartParams"].get("metrics-export-port", "8080") == "8080"
    others = [
        template
        for obj in objects
        if obj["kind"] != "RayCluster"
        for template in render.pod_templates(obj)
    ]
    for template in others:  # the store, the retriever, the Argo steps
        labels = template.metadata.get("labels") or {}
        assert not selects(monitor["spec"]["selector"], labels), template.source


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_only_the_monitoring_namespace_reaches_the_metrics_port(
    built: render.Builds, ray_pods: Callable[..., Any], overlay: str
) -> None:
    objects = built[overlay]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = ray_pods(the(objects, "RayCluster"))
    elsewhere = ("kubeflow", namespace_labels("kubeflow"), PROMETHEUS[2])
    not_ray = ("trace-rl", namespace_labels("trace-rl"), {"app.kubernetes.io/name": "trace-store"})
    for pod in pods:
        target = ("trace-rl", pod.labels)
        assert admits(policies, (*target, 8080), PROMETHEUS), pod.source
        assert not admits(policies, (*target, 8080), elsewhere), pod.source
        assert not admits(policies, (*target, 8080), not_ray), pod.source
        for port in (6379, 8265, 10001):  # GCS, the dashboard and job API, Ray client
            assert not admits(policies, (*target, port), PROMETHEUS), (pod.source, port)
        own = ("trace-rl", namespace_labels("trace-rl"), pods[0].labels)
        assert admits(policies, (*target, 8080), own)  # Ray's own pods, on every port


def test_the_vendored_pod_monitor_crd_is_the_releases() -> None:
    """tests/schemas/prometheus-operator: v0.93.0's file, byte for byte (its README)."""
    path = Path(render.REPO, "tests", "schemas", "prometheus-operator")
    data = gzip.decompress((path / "monitoring.coreos.com_podmonitors.yaml.gz").read_bytes())
    expected = "45a93443daa687d3654f7e9631909ff7edcdf3ec09c5e60251b74aa2722aee5d"
    assert hashlib.sha256(data).hexdigest() == expected
    assert b"operator.prometheus.io/version: 0.93.0" in data
