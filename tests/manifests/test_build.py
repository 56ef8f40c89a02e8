"""Every overlay builds offline, and what it builds is valid for the API server that will get it.

- core kinds: kubernetes-validate --strict against Kubernetes 1.32 (unknown fields are errors);
- RayCluster, RayJob and the Argo kinds: jsonschema against the upstream CRD schemas, made strict
  the way ``kubectl apply`` (server-side field validation, strict by default) treats them;
- the pod templates inside custom kinds: as core PodTemplates, strictly (a CRD schema alone
  would let a misspelt container field through, and the API server would drop it silently).

Not checked offline: CEL rules of the CRDs (``x-kubernetes-validations``), admission webhooks,
and anything a controller decides at run time.
"""

from __future__ import annotations

import copy
import gzip
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support import render

from components.cluster import DEFAULT_S3_ENDPOINT

KUBERNETES = "1.32"
PROMETHEUS = "prometheus-operator"  # the Prometheus Operator's CRDs (v0.93.0): tests/schemas
CRD_FILES = {
    ("ray.io", "RayCluster"): "kuberay/ray.io_rayclusters.yaml",
    ("ray.io", "RayJob"): "kuberay/ray.io_rayjobs.yaml",
    ("ray.io", "RayCronJob"): "kuberay/ray.io_raycronjobs.yaml",
    ("argoproj.io", "Workflow"): "argo/argoproj.io_workflows.yaml",
    ("argoproj.io", "CronWorkflow"): "argo/argoproj.io_cronworkflows.yaml",
    ("argoproj.io", "WorkflowTemplate"): "argo/argoproj.io_workflowtemplates.yaml",
    ("monitoring.coreos.com", "PodMonitor"): f"{PROMETHEUS}/monitoring.coreos.com_podmonitors.yaml",
}
Manifest = dict[str, Any]


def group_of(obj: Manifest) -> str:
    api = obj["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def is_custom(obj: Manifest) -> bool:
    return "." in group_of(obj) and not group_of(obj).endswith(".k8s.io")


def strict(schema: Any) -> Any:
    """A CRD schema in which objects with listed properties accept no other field."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if k != "properties"}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


@cache
def crd_validator(schemas: Path, group: str, kind: str, version: str) -> jsonschema.Validator:
    path = schemas / CRD_FILES[(group, kind)]
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            schema = strict(served["schema"]["openAPIV3Schema"])
            return jsonschema.Draft202012Validator(schema)
    raise AssertionError(f"{path}: no version {version} of {kind}")


@pytest.mark.parametrize("overlay", ["base", *render.OVERLAYS])
def test_every_overlay_builds(built: dict[str, list[Manifest]], overlay: str) -> None:
    kinds = {obj["kind"] for obj in built[overlay]}
    assert {"Namespace", "ServiceAccount", "RayCluster", "NetworkPolicy", "Secret"} <= kinds


def test_overlays_hold_what_they_promise(built: dict[str, list[Manifest]]) -> None:
    def names(overlay: str, kind: str) -> set[str]:
        return {
            f"{o['metadata'].get('namespace', '')}/{o['metadata']['name']}"
            for o in built[overlay]
            if o["kind"] == kind
        }

    # KFP: no store of its own; the Ray token also where KFP's steps run; KFP's store admits Ray.
    assert names("kfp", "Deployment") == {"trace-rl/trace-retriever"}
    assert names("kfp", "Service") == {"trace-rl/trace-retriever"}
    assert not names("kfp", "PersistentVolumeClaim")
    assert names("kfp", "Secret") == {
        "trace-rl/trace-s3",
        "trace-rl/trace-ray-auth",
        "kubeflow/trace-ray-auth",
    }
    assert "kubeflow/seaweedfs-from-trace-rl" in names("kfp", "NetworkPolicy")
    (settings,) = [
        o["data"]
        for o in built["kfp"]
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "trace-rl-settings"
    ]
    assert settings["AWS_ENDPOINT_URL_S3"] == DEFAULT_S3_ENDPOINT  # test_kfp_store.py: why
    # standalone and dev: the store; standalone and kfp: the retrieval server (not dev: its
    # envs search the in-process BM25); standalone: the Argo CronWorkflow of the pipeline.
    for overlay, retriever in (("standalone", {"trace-rl/trace-retriever"}), ("dev", set())):
        assert names(overlay, "Deployment") == {"trace-rl/trace-store", *retriever}
        assert names(overlay, "Service") == {"trace-rl/trace-store", *retriever}
        assert names(overlay, "PersistentVolumeClaim") == {"trace-rl/trace-store"}
    assert names("standalone", "CronWorkflow"), "the standalone overlay has no Argo CronWorkflow"
    # dev: no GPU anywhere.
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(built["dev"])


@pytest.mark.parametrize("overlay", ["base", *render.OVERLAYS])
def test_namespaces(built: dict[str, list[Manifest]], overlay: str) -> None:
    """Everything in trace-rl, except what the KFP overlay puts where KFP's steps run."""
    allowed = {"trace-rl", "kubeflow"} if overlay == "kfp" else {"trace-rl"}
    for obj in built[overlay]:
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == "trace-rl"
            continue
        namespace = obj["metadata"].get("namespace")
        assert namespace in allowed, f"{render.name_of(obj)}: namespace {namespace!r}"


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_core_kinds_validate_strictly(built: dict[str, list[Manifest]], overlay: str) -> None:
    core = [obj for obj in built[overlay] if not is_custom(obj)]
    assert core
    for obj in core:
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{overlay}: {render.name_of(obj)} at {path}: {e.message}")


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_custom_kinds_validate_against_upstream_crds(
    built: dict[str, list[Manifest]], overlay: str, schemas: Path
) -> None:
    custom = [obj for obj in built[overlay] if is_custom(obj)]
    assert any(obj["kind"] == "RayCluster" for obj in custom)
    for obj in custom:
        group, version = obj["apiVersion"].split("/")
        assert (group, obj["kind"]) in CRD_FILES, f"no schema for {render.name_of(obj)}"
        validator = crd_validator(schemas, group, obj["kind"], version)
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, f"{overlay}: {render.name_of(obj)}:\n" + "\n".join(
            f"  {'.'.join(str(p) for p in e.path)}: {e.message}" for e in errors
        )


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_embedded_pod_templates_validate_strictly(
    built: dict[str, list[Manifest]], overlay: str
) -> None:
    templates = [t for obj in built[overlay] if is_custom(obj) for t in render.pod_templates(obj)]
    assert templates
    for template in templates:
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "check"},
            "template": {"metadata": template.metadata, "spec": copy.deepcopy(template.spec)},
        }
        try:
            kubernetes_validate.validate(pod_template, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{overlay}: {template.source} at {path}: {e.message}")


def test_strict_crd_schema_rejects_a_misspelt_field(schemas: Path) -> None:
    """The CRD check would catch a typo (the API server would reject it too)."""
    validator = crd_validator(schemas, "ray.io", "RayCluster", "v1")
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "x"},
        "spec": {
            "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": []}}},
            "enableInTreeAutoscalling": True,
        },
    }
    messages = [e.message for e in validator.iter_errors(cluster)]
    assert any("enableInTreeAutoscalling" in m for m in messages), messages


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_the_monitoring_component_validates_against_its_crd(
    tmp_path: Path, schemas: Path, overlay: str
) -> None:
    """manifests/monitoring, in no overlay by default (its kind needs the Prometheus Operator's
    CRD), added to each: its PodMonitor is valid for that CRD, strictly (a misspelt field of
    its endpoint would be refused too)."""
    objects = render.build_with(tmp_path, overlay, "monitoring")
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    validator = crd_validator(schemas, "monitoring.coreos.com", "PodMonitor", "v1")
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(monitor)]
    assert not errors, errors
    misspelt = copy.deepcopy(monitor)
    misspelt["spec"]["podMetricsEndpoints"][0]["relabellings"] = []
    assert any("relabellings" in e.message for e in validator.iter_errors(misspelt))


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_references_resolve(built: dict[str, list[Manifest]], overlay: str) -> None:
    """Every Secret, ConfigMap, ServiceAccount and claim a pod names is in the same build."""
    have = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in built[overlay]
    }
    for obj in built[overlay]:
        namespace = obj["metadata"].get("namespace")
        wanted: list[tuple[str, str]] = []
        if obj["kind"] == "RayCluster" and obj["spec"].get("authOptions", {}).get("secretName"):
            wanted.append(("Secret", obj["spec"]["authOptions"]["secretName"]))
        for template in render.pod_templates(obj):
            spec = template.spec
            if spec.get("serviceAccountName"):
                wanted.append(("ServiceAccount", spec["serviceAccountName"]))
            for volume in spec.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    wanted.append(("PersistentVolumeClaim", claim))
                if "secret" in volume:
                    wanted.append(("Secret", volume["secret"]["secretName"]))
            for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
                for source in container.get("envFrom", []):
                    if "secretRef" in source:
                        wanted.append(("Secret", source["secretRef"]["name"]))
                    if "configMapRef" in source:
                        wanted.append(("ConfigMap", source["configMapRef"]["name"]))
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {})
                    if any(r.get("optional") for r in ref.values()):
                        continue  # unset where it is not created (a run store's, when none)
                    if "secretKeyRef" in ref:
                        wanted.append(("Secret", ref["secretKeyRef"]["name"]))
                    if "configMapKeyRef" in ref:
                        wanted.append(("ConfigMap", ref["configMapKeyRef"]["name"]))
        for kind, name in wanted:
            assert (kind, namespace, name) in have, (
                f"{overlay}: {render.name_of(obj)} refers to {kind} {namespace}/{name}, "
                "which the overlay does not create"
            )


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_ray_version_is_the_locks(built: dict[str, list[Manifest]], overlay: str) -> None:
    lock = (render.REPO / "requirements" / "constraints.txt").read_text().splitlines()
    ray = next(line.split("==")[1] for line in lock if line.startswith("ray=="))
    cluster = next(o for o in built[overlay] if o["kind"] == "RayCluster")
    assert cluster["spec"]["rayVersion"] == ray


def test_vendored_schemas_are_the_shared_ones() -> None:
    """tests/schemas holds gzipped copies for checkouts without shared/ beside them."""
    shared, vendored = render.REPO.parent / "shared" / "schemas", render.REPO / "tests" / "schemas"
    if not shared.is_dir():
        pytest.skip(f"{shared} is not here to compare with; the vendored copies are used")
    packed = [p for p in sorted(vendored.rglob("*.gz")) if (shared / p.parent.name).is_dir()]
    assert len(packed) == 6  # the PodMonitor's CRD is vendored only (tests/schemas/README.md)
    for path in packed:
        upstream = shared / path.relative_to(vendored).with_suffix("")
        assert gzip.decompress(path.read_bytes()) == upstream.read_bytes(), path
