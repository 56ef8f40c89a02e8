"""The compiled pipeline reaches the Ray cluster the kfp overlay deploys, by default: the run
parameter ray_jobs_url's default names that overlay's head Service (KubeRay's
``<cluster>-head-svc`` in the cluster's namespace) on the dashboard port the head exposes, and
the overlay's network policy lets KFP's step pods reach that port."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pipelines.trace_training import RAY_JOBS_URL, PipelineOptions


def test_the_default_job_url_is_the_kfp_overlays_head(built: Any) -> None:
    objects = built["kfp"]
    (cluster,) = [o for o in objects if o["kind"] == "RayCluster"]
    url = urlsplit(PipelineOptions().ray_jobs_url)
    assert PipelineOptions().ray_jobs_url == RAY_JOBS_URL
    name, namespace = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    assert url.hostname == f"{name}-head-svc.{namespace}.svc.cluster.local"
    head = cluster["spec"]["headGroupSpec"]
    (container,) = [c for c in head["template"]["spec"]["containers"] if c["name"] == "ray-head"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert url.port == ports["dashboard"] == 8265
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"

    (policy,) = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "trace-ray-head"
    ]
    from_kubeflow = [
        rule
        for rule in policy["spec"]["ingress"]
        if any(
            peer.get("namespaceSelector", {})
            .get("matchLabels", {})
            .get("kubernetes.io/metadata.name")
            == "kubeflow"
            for peer in rule.get("from", [])
        )
    ]
    assert any(
        {"protocol": "TCP", "port": url.port} in rule.get("ports", []) for rule in from_kubeflow
    ), "the kfp overlay must admit KFP's step pods on the head's job port"
