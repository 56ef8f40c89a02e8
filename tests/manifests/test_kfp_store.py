"""The kfp overlay against every KFP release it supports (``components.cluster.KFP_VERSIONS``),
read from that release's own manifests, kept unchanged in tests/data/kfp/<release>/ (each file's
first line names where in kubeflow/pipelines it comes from):

- the default S3 endpoint's Service and port exist in that release, and lead to the store pods;
- KFP's network policies and the overlay's, together, admit the Ray pods and the retrieval
  server of trace-rl and the pipeline's step pods (in kubeflow, or in a profile's namespace) to
  the store's S3 port;
- the default store prefix is one a profile's keys may write (KFP's profile controller, sync.py).

Network policies are evaluated as the Kubernetes API defines them (``support.netpol``). Pods'
and namespaces' labels are those the API server and KubeRay set (``kubernetes.io/metadata.name``;
``kuberay_pods``).
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from support import render
from support.netpol import admits, namespace_labels, selects, sends

from components.cluster import (
    DEFAULT_S3_ENDPOINT,
    DEFAULT_STORE_URI,
    KFP_BUCKET,
    KFP_NAMESPACE,
    KFP_VERSIONS,
)

DATA = render.REPO / "tests" / "data" / "kfp"
UPSTREAM = "github.com/kubeflow/pipelines"
VERSIONS = sorted(KFP_VERSIONS)
PROFILE = "team-a"
PROFILE_LABELS = {"app.kubernetes.io/part-of": "kubeflow-profile"}
"""The label KFP's SeaweedFS policy selects profile namespaces by."""
STEP_LABELS = {"workflows.argoproj.io/workflow": "trace-training-abcde"}
"""What a KFP run's step pod carries (Argo's workflow label)."""
Manifest = dict[str, Any]


def header(path: Path) -> tuple[str, str]:
    """(tag, path in kubeflow/pipelines) from a data file's first line."""
    first = path.read_text().splitlines()[0]
    prefix = f"# From {UPSTREAM}, tag "
    assert first.startswith(prefix) and first.endswith("; unchanged below this line."), first
    tag, _, rest = first.removeprefix(prefix).partition(" (commit ")
    commit, _, source = rest.partition("), ")
    assert len(commit) == 40, first
    return tag, source.removesuffix("; unchanged below this line.")


def release(version: str) -> list[Manifest]:
    """The Services, Deployments and NetworkPolicies of ``version``'s data files."""
    objects = []
    for path in sorted((DATA / version).glob("*.yaml")):
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return [o for o in objects if o["kind"] in ("Service", "Deployment", "NetworkPolicy")]


def in_namespace(obj: Manifest) -> Manifest:
    """``obj`` with KFP's namespace where its file leaves it to the kustomization."""
    return {**obj, "metadata": {"namespace": KFP_NAMESPACE, **obj["metadata"]}}


def named(objects: list[Manifest], kind: str, name: str) -> Manifest | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def store_pod(version: str) -> tuple[dict[str, str], list[int]]:
    """The labels and container ports of ``version``'s SeaweedFS pod."""
    deployment = named(release(version), "Deployment", "seaweedfs")
    assert deployment, f"{version}: no seaweedfs Deployment"
    template = deployment["spec"]["template"]
    ports = [p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]]
    return template["metadata"]["labels"], ports


# -- network policies ---------------------------------------------------------------------


def kfp_policies(version: str) -> list[Manifest]:
    return [in_namespace(o) for o in release(version) if o["kind"] == "NetworkPolicy"]


def overlay_policies(built: render.Builds) -> list[Manifest]:
    return [o for o in built["kfp"] if o["kind"] == "NetworkPolicy"]


# -- the data ---------------------------------------------------------------------------------


def test_the_data_is_every_supported_release_and_names_its_source() -> None:
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == VERSIONS
    for version in VERSIONS:
        files = sorted((DATA / version).iterdir())
        assert files
        for path in files:
            tag, source = header(path)
            assert tag == version, path
            assert Path(source).name in path.name, path


@pytest.mark.parametrize("version", VERSIONS)
def test_the_data_holds_every_policy_and_service_the_install_applies(version: str) -> None:
    """KFP's store (third-party/seaweedfs) and pipeline (base/pipeline) kustomizations: each
    NetworkPolicy and Service file they list is here, so the policies below are all of them."""
    have = {header(p)[1] for p in (DATA / version).iterdir()}
    for kustomization in ("seaweedfs-kustomization.yaml", "pipeline-kustomization.yaml"):
        path = DATA / version / kustomization
        folder = str(Path(header(path)[1]).parent)
        listed = yaml.safe_load(path.read_text())["resources"]
        for resource in listed:
            if resource.endswith(("networkpolicy.yaml", "service.yaml")) and "/" not in resource:
                if kustomization.startswith("pipeline") and "networkpolicy" not in resource:
                    continue  # the pipeline's Services (API, UI) are not the store's
                assert f"{folder}/{resource}" in have, f"{version}: {resource} is not in {DATA}"


# -- the endpoint -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_the_default_endpoint_is_served_by_the_release(version: str) -> None:
    wiring = KFP_VERSIONS[version]
    assert wiring.endpoint == DEFAULT_S3_ENDPOINT
    url = urlsplit(DEFAULT_S3_ENDPOINT)
    assert url.scheme == "http" and url.hostname and url.port
    service_name, namespace = url.hostname.split(".")[:2]
    assert url.hostname == f"{service_name}.{namespace}.svc.cluster.local"
    assert (service_name, namespace) == (wiring.service, KFP_NAMESPACE)
    service = named(release(version), "Service", service_name)
    assert service, f"KFP {version} has no Service {service_name}"
    assert service["metadata"].get("namespace", KFP_NAMESPACE) == namespace
    ports = {p["port"]: p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
    assert url.port in ports, f"KFP {version}: {service_name} serves {sorted(ports)} only"
    labels, container_ports = store_pod(version)
    assert ports[url.port] == wiring.pod_port and wiring.pod_port in container_ports
    assert selects({"matchLabels": service["spec"]["selector"]}, labels)
    assert selects({"matchLabels": dict(wiring.pod_labels)}, labels)


def test_no_single_legacy_address_serves_both_releases() -> None:
    """Why the default is seaweedfs:8333: 2.15.0's seaweedfs has no 9000 (minio-service has),
    and 2.16.0 has no minio-service (seaweedfs has 9000)."""
    assert set(VERSIONS) >= {"2.15.0", "2.16.0"}

    def serves(version: str, service: str, port: int) -> bool:
        found = named(release(version), "Service", service)
        return bool(found) and any(p["port"] == port for p in found["spec"]["ports"])

    assert not serves("2.15.0", "seaweedfs", 9000) and serves("2.15.0", "minio-service", 9000)
    assert serves("2.16.0", "seaweedfs", 9000) and not serves("2.16.0", "minio-service", 9000)


@pytest.mark.parametrize("overlay", ["base", *render.OVERLAYS])
def test_the_settings_hold_only_what_the_pods_read(built: render.Builds, overlay: str) -> None:
    """trace-rl-settings: the S3 endpoint and region, which the Ray pods' and steps' env read;
    kfp's endpoint is the default. No key that nothing reads (a store URI, a Ray address)."""
    (settings,) = [
        o
        for o in built[overlay]
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "trace-rl-settings"
    ]
    assert set(settings["data"]) == {"AWS_ENDPOINT_URL_S3", "AWS_REGION"}
    read = {
        env["valueFrom"]["configMapKeyRef"]["key"]
        for obj in built[overlay]
        for template in render.pod_templates(obj)
        for container in template.spec.get("containers", [])
        for env in container.get("env", [])
        if "configMapKeyRef" in env.get("valueFrom", {})
    }
    assert set(settings["data"]) <= read
    if overlay == "kfp":
        assert settings["data"]["AWS_ENDPOINT_URL_S3"] == DEFAULT_S3_ENDPOINT


# -- who reaches the store --------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_the_ray_pods_reach_the_store(
    built: render.Builds, ray_pods: Callable[..., Any], version: str
) -> None:
    labels, _ = store_pod(version)
    store = (KFP_NAMESPACE, labels, KFP_VERSIONS[version].pod_port)
    (namespace,) = [o for o in built["kfp"] if o["kind"] == "Namespace"]
    trace_ns = namespace["metadata"]["name"]
    trace_labels = namespace_labels(trace_ns, namespace["metadata"].get("labels"))
    (cluster,) = [o for o in built["kfp"] if o["kind"] == "RayCluster"]
    pods = ray_pods(cluster)
    assert [p.group for p in pods] == ["headgroup", "gpu"]
    for pod in pods:
        source = (trace_ns, trace_labels, pod.labels)
        assert admits(kfp_policies(version) + overlay_policies(built), store, source), pod.source
        # KFP's policies alone would refuse them: the overlay's policy is what admits them.
        assert not admits(kfp_policies(version), store, source), pod.source


@pytest.mark.parametrize("version", VERSIONS)
def test_the_retriever_reaches_the_store(built: render.Builds, version: str) -> None:
    """The retrieval server downloads its index from KFP's store: its own egress rule lets it
    out, the overlay's policy in kubeflow lets it in; KFP's policies alone would refuse it."""
    labels, _ = store_pod(version)
    port = KFP_VERSIONS[version].pod_port
    store = (KFP_NAMESPACE, labels, port)
    (namespace,) = [o for o in built["kfp"] if o["kind"] == "Namespace"]
    trace_ns = namespace["metadata"]["name"]
    trace_labels = namespace_labels(trace_ns, namespace["metadata"].get("labels"))
    (deployment,) = [o for o in built["kfp"] if o["kind"] == "Deployment"]
    source = (trace_ns, trace_labels, deployment["spec"]["template"]["metadata"]["labels"])
    assert admits(kfp_policies(version) + overlay_policies(built), store, source)
    assert not admits(kfp_policies(version), store, source)
    target = (KFP_NAMESPACE, namespace_labels(KFP_NAMESPACE), labels)
    assert sends(overlay_policies(built), source, target, port)
    assert not sends(overlay_policies(built), source, target, port + 1)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_steps_reach_the_store(built: render.Builds, version: str) -> None:
    """KFP's own policies admit its step pods: in kubeflow (2.15.0 by default-allow-same-
    namespace, 2.16.0 by SeaweedFS's policy) and in a profile's namespace (multi-user)."""
    labels, _ = store_pod(version)
    store = (KFP_NAMESPACE, labels, KFP_VERSIONS[version].pod_port)
    for namespace, extra in ((KFP_NAMESPACE, {}), (PROFILE, PROFILE_LABELS)):
        source = (namespace, namespace_labels(namespace, extra), STEP_LABELS)
        assert admits(kfp_policies(version), store, source), (version, namespace)
        assert admits(kfp_policies(version) + overlay_policies(built), store, source)


def test_the_ray_head_admits_the_steps_of_kubeflow(
    built: render.Builds, ray_pods: Callable[..., Any]
) -> None:
    """The overlay's side: KFP's steps in kubeflow reach the head's job port, not its others."""
    (cluster,) = [o for o in built["kfp"] if o["kind"] == "RayCluster"]
    head = next(p for p in ray_pods(cluster) if p.group == "headgroup")
    step = (KFP_NAMESPACE, namespace_labels(KFP_NAMESPACE), STEP_LABELS)
    policies = overlay_policies(built)
    assert admits(policies, ("trace-rl", head.labels, 8265), step)
    assert not admits(policies, ("trace-rl", head.labels, 6379), step)


def test_the_evaluator_reads_selectors_as_kubernetes_does() -> None:
    """Hand-made cases: matchExpressions, a peer's podSelector alone (same namespace only), a
    rule's ports, and a pod no policy selects."""
    store = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["s"]}]}
    policy = {
        "metadata": {"namespace": "a"},
        "spec": {
            "podSelector": store,
            "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 80}]}],
        },
    }
    same, other = ("a", namespace_labels("a"), {}), ("b", namespace_labels("b"), {})
    assert admits([policy], ("a", {"app": "s"}, 80), same)
    assert not admits([policy], ("a", {"app": "s"}, 81), same)
    assert not admits([policy], ("a", {"app": "s"}, 80), other)
    assert admits([policy], ("a", {"app": "t"}, 81), other)  # not selected: open


# -- multi-user: the profile's keys -----------------------------------------------------------


def profile_policy(version: str, namespace: str) -> tuple[list[str], list[str], str]:
    """(actions, resources, lifecycle-expired prefix) of ``version``'s profile controller, read
    from its sync.py: the IAM policy it puts on each profile's user, with ``namespace``."""
    tree = ast.parse((DATA / version / "sync.py.txt").read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def value(node: Any) -> Any:
        """A literal, with f-strings filled in from the module's constants and ``namespace``."""
        if isinstance(node, ast.JoinedStr):
            names = {**constants, "namespace": namespace}
            parts = node.values
            return "".join(
                str(names[p.value.id]) if isinstance(p, ast.FormattedValue) else str(p.value)
                for p in parts
            )
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        return ast.literal_eval(node)

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    (put,) = [c for c in calls if getattr(c.func, "attr", "") == "put_user_policy"]
    document = next(k.value for k in put.keywords if k.arg == "PolicyDocument")
    assert isinstance(document, ast.Call) and getattr(document.func, "attr", "") == "dumps"
    (statement,) = value(document.args[0])["Statement"]
    assert statement["Effect"] == "Allow"
    (expiring,) = [  # the lifecycle rule's {"Prefix": ...}
        value(v)
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
        for k, v in zip(n.keys, n.values, strict=True)
        if isinstance(k, ast.Constant) and k.value == "Filter"
    ]
    return statement["Action"], statement["Resource"], expiring["Prefix"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_default_store_is_writable_with_a_profiles_keys(version: str) -> None:
    """The default prefix, the same for every profile, is under one the profile's keys may
    get, put and list, and outside the one KFP's lifecycle rule expires; so is a profile's
    private alternative (docs/deploy.md, section 8)."""
    actions, resources, expired = profile_policy(version, PROFILE)
    assert {"s3:Put*", "s3:Get*", "s3:List*"} <= set(actions)
    prefixes = [p.format(namespace=PROFILE) for p in KFP_VERSIONS[version].profile_prefixes]
    assert resources == [f"arn:aws:s3:::{KFP_BUCKET}/{p}*" for p in prefixes]
    url = urlsplit(DEFAULT_STORE_URI)
    assert url.scheme == "s3" and url.hostname == KFP_BUCKET
    default = url.path.strip("/")
    private = f"private/{PROFILE}/trace-rl"
    for prefix in (default, private):
        key = f"{prefix}/checkpoints/nightly/iter-0005/policy/model.safetensors"
        arn = f"arn:aws:s3:::{KFP_BUCKET}/{key}"
        assert any(fnmatch.fnmatchcase(arn, r) for r in resources), (arn, resources)
        assert not key.startswith(expired)
    assert PROFILE not in default


def test_the_deploy_guide_names_the_supported_releases_and_the_store() -> None:
    guide = (render.REPO / "docs" / "deploy.md").read_text()
    (row,) = [line for line in guide.splitlines() if line.startswith("| Kubeflow Pipelines |")]
    for version in VERSIONS:
        assert version in row, f"docs/deploy.md's prerequisites do not name KFP {version}"
    assert DEFAULT_STORE_URI in guide and DEFAULT_S3_ENDPOINT in guide
