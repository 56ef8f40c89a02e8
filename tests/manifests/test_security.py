"""Nothing insecure in what a platform team applies: no literal credential, no root, no
unbounded container, no token or port open that a pod does not need.

The namespace enforces Pod Security "restricted" (namespace.yaml), so the API server itself
would refuse a pod that broke its rules; these tests find that before a cluster does, for every
pod the overlays will cause: Deployments, the RayCluster's head and worker groups (and the
autoscaler sidecar KubeRay adds to the head), and the Argo workflow steps.
"""

from __future__ import annotations

import base64
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import render

Manifest = dict[str, Any]
SECRET_WORDS = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL|PRIVATE")
LITERALS = {
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "KFP's default store password": re.compile(r"\bminio123\b"),
    "credentials in a URL": re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@"),
}
GENERATED_SECRETS = {"trace-s3", "trace-ray-auth"}


def tracked_manifest_files() -> list[Path]:
    """Every file under manifests/ except the env files git ignores (a developer's real ones)."""
    return sorted(
        p
        for p in render.MANIFESTS.rglob("*")
        if p.is_file() and not (p.suffix == ".env" and p.parent.parent.name == "secrets")
    )


def containers(spec: Manifest) -> list[Manifest]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def all_pods(objects: list[Manifest]) -> list[render.PodTemplate]:
    pods = [template for obj in objects for template in render.pod_templates(obj)]
    for obj in objects:  # the autoscaler sidecar KubeRay adds to the head pod
        if obj["kind"] == "RayCluster" and obj["spec"].get("enableInTreeAutoscaling"):
            head = obj["spec"]["headGroupSpec"]["template"]
            sidecar = {"name": "autoscaler", **obj["spec"].get("autoscalerOptions", {})}
            spec = {**head["spec"], "containers": [sidecar]}
            pods.append(render.PodTemplate(f"{render.name_of(obj)}, autoscaler", {}, spec))
    return pods


def test_no_literal_credentials_in_tracked_files() -> None:
    files = tracked_manifest_files()
    assert files
    for path in files:
        text = path.read_text()
        for what, pattern in LITERALS.items():
            assert not pattern.search(text), f"{path}: holds a {what}"
        if path.suffix not in (".yaml", ".yml"):
            continue
        for doc in yaml.safe_load_all(text):
            if not isinstance(doc, dict):
                continue
            assert doc.get("kind") != "Secret", f"{path}: a Secret in git (use a secretGenerator)"
            for item in yaml_items(doc):
                if isinstance(item, dict) and "name" in item and "value" in item:
                    name = str(item["name"])
                    assert not SECRET_WORDS.search(name.upper()), (
                        f"{path}: {name} is set to a literal value; take it from a Secret"
                    )


def yaml_items(node: Any) -> list[Any]:
    """Every mapping and list item below ``node``."""
    found = [node]
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    for child in children:
        found.extend(yaml_items(child))
    return found


def test_env_examples_hold_no_value() -> None:
    examples = sorted(render.MANIFESTS.glob("secrets/*/*.env.example"))
    assert {p.name for p in examples} == {"s3.env.example", "ray-auth.env.example"}
    for example in examples:
        for line in example.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                name, _, value = line.partition("=")
                assert value == "", f"{example}: {name} has a value; examples must be empty"


def test_env_files_are_ignored_by_git() -> None:
    for name in ("s3/s3.env", "ray-auth/ray-auth.env"):
        path = f"manifests/secrets/{name}"
        done = subprocess.run(
            ["git", "check-ignore", "-q", path], cwd=render.REPO, capture_output=True, check=False
        )
        assert done.returncode == 0, f"{path} is not ignored by git: it would hold credentials"


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_secrets_come_only_from_the_untracked_env_files(built: render.Builds, overlay: str) -> None:
    """The only Secrets are the generated ones, and built from the empty examples they are empty:
    nothing tracked put a value in them."""
    secrets = [obj for obj in built[overlay] if obj["kind"] == "Secret"]
    assert {s["metadata"]["name"] for s in secrets} == GENERATED_SECRETS
    for secret in secrets:
        assert "stringData" not in secret
        values = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
        assert values and all(v == "" for v in values.values()), (
            f"{overlay}: {render.name_of(secret)} holds a value that is not from its env file"
        )


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_every_container_runs_as_non_root(built: render.Builds, overlay: str) -> None:
    pods = all_pods(built[overlay])
    assert pods
    for pod in pods:
        pod_security = pod.spec.get("securityContext") or {}
        for container in containers(pod.spec):
            security = container.get("securityContext") or {}
            non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
            user = security.get("runAsUser", pod_security.get("runAsUser"))
            where = f"{overlay}: {pod.source}, container {container['name']}"
            assert non_root is True, f"{where}: runAsNonRoot is not true"
            assert user != 0, f"{where}: runAsUser is 0"
            assert security.get("privileged") is not True, f"{where}: privileged"
            assert security.get("allowPrivilegeEscalation") is False, (
                f"{where}: allowPrivilegeEscalation must be false"
            )
            assert security.get("capabilities", {}).get("drop") == ["ALL"], (
                f"{where}: must drop ALL capabilities"
            )
            seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", f"{where}: no RuntimeDefault seccomp"


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_every_container_has_requests_and_limits(built: render.Builds, overlay: str) -> None:
    for pod in all_pods(built[overlay]):
        for container in containers(pod.spec):
            resources = container.get("resources") or {}
            for bound in ("requests", "limits"):
                have = set(resources.get(bound) or {})
                assert {"cpu", "memory"} <= have, (
                    f"{overlay}: {pod.source}, container {container['name']}: "
                    f"resources.{bound} lacks {sorted({'cpu', 'memory'} - have)}"
                )


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_no_host_access(built: render.Builds, overlay: str) -> None:
    for pod in all_pods(built[overlay]):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.spec.get(key), f"{overlay}: {pod.source}: {key}"
        for volume in pod.spec.get("volumes", []):
            assert "hostPath" not in volume, f"{overlay}: {pod.source}: hostPath volume"


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_tokens_only_where_the_api_is_used(built: render.Builds, overlay: str) -> None:
    """Only the Argo steps (their executor) get a token by automounting; the Ray head's
    autoscaler gets its own by a volume (next test)."""
    accounts = {o["metadata"]["name"]: o for o in built[overlay] if o["kind"] == "ServiceAccount"}
    for name in ("trace-ray-worker", "trace-ray-head"):
        assert accounts[name].get("automountServiceAccountToken") is False, name
    for obj in built[overlay]:
        for pod in render.pod_templates(obj):
            mounted = pod.spec.get("automountServiceAccountToken")
            if mounted is None:
                account = accounts.get(pod.spec.get("serviceAccountName", "default"), {})
                mounted = account.get("automountServiceAccountToken", True)
            assert mounted is False or obj["kind"] in render.ARGO_KINDS, (
                f"{overlay}: {pod.source} mounts a service account token it has no use for"
            )


TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Ray's autoscaler reads the token and the cluster's CA (ray/autoscaler/_private/kuberay/
node_provider.py: IN_CLUSTER_TOKEN_PATH, IN_CLUSTER_CA_CERT_PATH)."""


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_only_the_autoscaler_holds_the_heads_token(
    built: render.Builds, ray_pods: Callable[..., Any], overlay: str
) -> None:
    """The jobs' drivers run in ray-head: no token there; the autoscaler sidecar (KubeRay adds
    autoscalerOptions.volumeMounts to it alone) reads the token and CA where Ray reads them."""
    (cluster,) = [o for o in built[overlay] if o["kind"] == "RayCluster"]
    for pod in ray_pods(cluster):
        assert pod.spec.get("automountServiceAccountToken") is False, pod.source
        token_volumes = {
            v["name"]
            for v in pod.spec.get("volumes", [])
            if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))
        }
        holders = {
            c["name"]: m["mountPath"]
            for c in pod.spec["containers"]
            for m in c.get("volumeMounts", [])
            if m["name"] in token_volumes
        }
        if pod.group != "headgroup":
            assert holders == {}, pod.source
            continue
        assert holders == {"autoscaler": TOKEN_PATH}, f"{overlay}: {pod.source}: {holders}"
        (volume,) = [v for v in pod.spec["volumes"] if v["name"] in token_volumes]
        files = {
            item["path"]
            for source in volume["projected"]["sources"]
            for item in (
                [source["serviceAccountToken"]]
                if "serviceAccountToken" in source
                else (source.get("configMap") or source.get("downwardAPI") or {}).get("items", [])
            )
        }
        assert {"token", "ca.crt"} <= files, files


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_roles_grant_only_what_the_steps_need(built: render.Builds, overlay: str) -> None:
    roles = [o for o in built[overlay] if o["kind"] in ("Role", "ClusterRole")]
    assert [r["kind"] for r in roles] == ["Role"], "one namespaced Role, no ClusterRole"
    assert roles[0]["rules"] == [
        {
            "apiGroups": ["argoproj.io"],
            "resources": ["workflowtaskresults"],
            "verbs": ["create", "patch"],
        }
    ]
    assert not [o for o in built[overlay] if o["kind"] == "ClusterRoleBinding"]


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_network_policies_guard_the_ray_head_and_the_store(
    built: render.Builds, overlay: str
) -> None:
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in built[overlay]
        if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == "trace-rl"
    }
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    # The head: its own cluster on any port; anyone else only on the job port.
    for rule in policies["trace-ray-head"]["ingress"]:
        peers = rule["from"]
        own_cluster = peers == [{"podSelector": {"matchLabels": {"ray.io/cluster": "trace-rl"}}}]
        assert own_cluster or rule.get("ports") == [{"protocol": "TCP", "port": 8265}], rule
    assert policies["trace-ray-workers"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": "trace-rl"}}}]}
    ]
    if overlay != "kfp":
        store = policies["trace-store"]["ingress"]
        assert [rule["ports"] for rule in store] == [[{"protocol": "TCP", "port": 8333}]]


def image_uid() -> int:
    """The UID both images create and run as (USER uid:gid in each Dockerfile)."""
    uids = set()
    for dockerfile in sorted((render.REPO / "images").glob("*/Dockerfile")):
        match = re.search(r"^USER (\d+):(\d+)$", dockerfile.read_text(), re.MULTILINE)
        assert match, f"{dockerfile}: no numeric USER uid:gid"
        uids.add(int(match[1]))
    assert len(uids) == 1, f"the images run as different users: {uids}"
    return uids.pop()


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_pods_of_the_project_images_run_as_their_user(built: render.Builds, overlay: str) -> None:
    """A pod of the trace images runs as the UID the images create (whose HOME is theirs)."""
    uid = image_uid()
    for pod in all_pods(built[overlay]):
        pod_security = pod.spec.get("securityContext") or {}
        for container in containers(pod.spec):
            name = str(container.get("image", "")).rsplit("/", 1)[-1].split(":")[0]
            if name not in ("trace", "trace-gpu") and container["name"] != "autoscaler":
                continue
            security = container.get("securityContext") or {}
            user = security.get("runAsUser", pod_security.get("runAsUser", uid))
            assert user == uid, (
                f"{overlay}: {pod.source}, container {container['name']}: runAsUser {user}, "
                f"but the images' user is {uid}"
            )
