"""The retrieval server (manifests/retriever) as the kfp and standalone overlays render it:

- it is in those two overlays, not in dev (whose envs search the in-process BM25 index);
- its pod downloads the index the ConfigMap trace-retriever names (INDEX_URI) from the overlay's
  store, with the Ray pods' S3 settings and credentials, into a volume (the root filesystem is
  read-only); the default index is under the overlay's store bucket;
- it is probed on /health, port 8000 (a startup probe long enough for a large index), and the
  Service trace-retriever selects it there, at the URL docs/deploy.md gives for retriever_url;
- the network policies admit the pods of a run (the Ray pods; the Argo steps of trace-rl; under
  KFP, KFP's steps in kubeflow) on port 8000 and nothing else, and let it reach only DNS and
  the store, which admits it.

The container's args are parsed by the real ``trace-rl retriever serve``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
from support import render
from support.netpol import admits, namespace_labels, selects, sends

from components.cluster import DEFAULT_STORE_URI, KFP_NAMESPACE, SEAWEEDFS

Manifest = dict[str, Any]
OVERLAYS = ("kfp", "standalone")
NAMESPACE = "trace-rl"
PORT = 8000
RETRIEVER_URL = f"http://trace-retriever.{NAMESPACE}.svc.cluster.local:{PORT}"
"""The run parameter retriever_url for the deployed server (docs/deploy.md)."""
STEP_LABELS = {"workflows.argoproj.io/workflow": "trace-training-abcde"}
"""What an Argo (or KFP) step pod carries."""
GIB = 2**30


def one(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def deployment(built: render.Builds, overlay: str) -> Manifest:
    return one(built[overlay], "Deployment", "trace-retriever")


def container(built: render.Builds, overlay: str) -> Manifest:
    (found,) = deployment(built, overlay)["spec"]["template"]["spec"]["containers"]
    return found


def arg(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def env_of(found: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in found.get("env", [])}


def pod_labels(built: render.Builds, overlay: str) -> dict[str, str]:
    return dict(deployment(built, overlay)["spec"]["template"]["metadata"]["labels"])


def policies(built: render.Builds, overlay: str) -> list[Manifest]:
    return [o for o in built[overlay] if o["kind"] == "NetworkPolicy"]


def trace_namespace(built: render.Builds, overlay: str) -> tuple[str, dict[str, str]]:
    namespace = one(built[overlay], "Namespace")
    name = namespace["metadata"]["name"]
    return name, namespace_labels(name, namespace["metadata"].get("labels"))


# -- where it is ------------------------------------------------------------------------------


def test_the_retriever_is_in_kfp_and_standalone_only(built: render.Builds) -> None:
    for overlay in OVERLAYS:
        for kind in ("Deployment", "Service", "ServiceAccount", "NetworkPolicy"):
            obj = one(built[overlay], kind, "trace-retriever")
            assert obj["metadata"]["namespace"] == NAMESPACE, (overlay, kind)
    assert not [o for o in built["dev"] if "retriever" in o["metadata"]["name"]]


# -- the pod ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_command_serves_the_configured_index(built: render.Builds, overlay: str) -> None:
    found = container(built, overlay)
    assert found["image"].rsplit("/", 1)[-1].split(":")[0] == "trace"  # the CPU image
    command = [*found["command"], *found["args"]]
    assert command[:3] == ["trace-rl", "retriever", "serve"]
    args = command[3:]
    assert arg(args, "--host") == "0.0.0.0"
    assert arg(args, "--port") == str(PORT)
    assert arg(args, "--index") == "$(INDEX_URI)"  # the kubelet expands it from the env
    ports = {p["name"]: p["containerPort"] for p in found["ports"]}
    assert ports == {"http": PORT}
    # The args parse with the real command (click parses them without running it).
    import typer

    from trace_core.cli import app

    group = typer.main.get_command(app)
    serve = group.commands["retriever"].commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", list(args)).params
    assert (params["index"], params["port"], params["host"]) == ("$(INDEX_URI)", PORT, "0.0.0.0")
    assert str(params["cache_dir"]) == arg(args, "--cache-dir")
    limit = found["resources"]["limits"]["cpu"]
    assert params["threads"] == int(limit), "torch's threads are the pod's CPU limit"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_index_uri_comes_from_the_config_map(built: render.Builds, overlay: str) -> None:
    ref = env_of(container(built, overlay))["INDEX_URI"]["configMapKeyRef"]
    config = one(built[overlay], "ConfigMap", ref["name"])
    # The generated name changes with its contents: a new INDEX_URI rolls the Deployment.
    assert ref["name"].startswith("trace-retriever-") and ref["name"] != "trace-retriever-"
    uri = urlsplit(config["data"][ref["key"]])
    assert uri.scheme == "s3" and uri.path.strip("/"), config["data"]
    if overlay == "kfp":  # under the runs' prefix in KFP's bucket
        assert config["data"][ref["key"]].startswith(f"{DEFAULT_STORE_URI}/indexes/")
    else:  # the bucket the standalone store creates
        store = one(built[overlay], "Deployment", "trace-store")
        (weed,) = store["spec"]["template"]["spec"]["containers"]
        assert f"-bucket={uri.hostname}" in weed["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_store_settings_are_the_ray_pods(built: render.Builds, overlay: str) -> None:
    cluster = one(built[overlay], "RayCluster")
    (head,) = [
        c
        for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        if c["name"] == "ray-head"
    ]
    ray, retriever = env_of(head), env_of(container(built, overlay))
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert retriever[name] == ray[name], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_it_writes_goes_to_its_volumes(built: render.Builds, overlay: str) -> None:
    spec = deployment(built, overlay)["spec"]["template"]["spec"]
    found = container(built, overlay)
    assert found["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in found["volumeMounts"]}
    env = env_of(found)
    for path in (arg(found["args"], "--cache-dir"), env["TMPDIR"], env["HOME"]):
        assert "emptyDir" in mounts[path], path
    # The cache holds the downloaded index: the comment's 1M passages × 768 dims × 4 bytes.
    cache = mounts[arg(found["args"], "--cache-dir")]["emptyDir"]["sizeLimit"]
    assert cache.endswith("Gi") and int(cache[:-2]) * GIB > 10**6 * 768 * 4


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_memory_holds_the_index_it_is_sized_for(built: render.Builds, overlay: str) -> None:
    resources = container(built, overlay)["resources"]
    requests, limits = resources["requests"], resources["limits"]
    assert requests["memory"].endswith("Gi") and limits["memory"].endswith("Gi")
    request, limit = int(requests["memory"][:-2]), int(limits["memory"][:-2])
    vectors = 10**6 * 768 * 4  # a flat E5-base index of 1M passages
    assert vectors < request * GIB <= limit * GIB
    assert float(requests["cpu"]) <= float(limits["cpu"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_health_on_the_servers_port(built: render.Builds, overlay: str) -> None:
    found = container(built, overlay)
    ports = {p["name"]: p["containerPort"] for p in found["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = found[kind]["httpGet"]
        assert probe["path"] == "/health", kind
        assert ports.get(probe["port"], probe["port"]) == PORT, kind
    startup = found["startupProbe"]
    # A large index loads for minutes: at least 15 of them before the kubelet restarts the pod.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60


# -- the Service ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_is_the_documented_url(built: render.Builds, overlay: str) -> None:
    service = one(built[overlay], "Service", "trace-retriever")
    spec = service["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    assert selects({"matchLabels": spec["selector"]}, pod_labels(built, overlay))
    others = [
        t
        for o in built[overlay]
        if o["kind"] in render.WORKLOAD_KINDS and o["metadata"]["name"] != "trace-retriever"
        for t in render.pod_templates(o)
    ]
    selector = {"matchLabels": spec["selector"]}
    assert not [t for t in others if selects(selector, t.metadata.get("labels") or {})]
    (port,) = spec["ports"]
    assert port["port"] == PORT and port.get("protocol", "TCP") == "TCP"
    ports = {p["name"]: p["containerPort"] for p in container(built, overlay)["ports"]}
    assert ports.get(port["targetPort"], port["targetPort"]) == PORT
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert f"http://{name}.{namespace}.svc.cluster.local:{port['port']}" == RETRIEVER_URL


def test_the_guide_gives_the_url_and_the_index_key() -> None:
    guide = (render.REPO / "docs" / "deploy.md").read_text()
    assert f"--param retriever_url={RETRIEVER_URL}" in guide
    assert f"-p retriever_url={RETRIEVER_URL}" in guide
    assert "INDEX_URI" in guide


# -- who reaches it, and what it reaches ------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_run_reaches_the_retriever_and_no_one_else(
    built: render.Builds, ray_pods: Callable[..., Any], overlay: str
) -> None:
    rules = policies(built, overlay)
    trace_ns, trace_labels = trace_namespace(built, overlay)
    retriever = (trace_ns, pod_labels(built, overlay), PORT)
    target = (trace_ns, trace_labels, pod_labels(built, overlay))
    pods = ray_pods(one(built[overlay], "RayCluster"))
    assert [p.group for p in pods] == ["headgroup", "gpu"]
    for pod in pods:  # the envs search from the jobs' drivers (head) and actors (workers)
        source = (trace_ns, trace_labels, pod.labels)
        assert admits(rules, retriever, source), pod.source
        assert sends(rules, source, target, PORT), pod.source  # Ray's egress is open
        assert not admits(rules, (trace_ns, pod_labels(built, overlay), PORT + 1), source)
    steps = [(trace_ns, trace_labels, STEP_LABELS)]  # Argo steps of this namespace
    kfp_step = (KFP_NAMESPACE, namespace_labels(KFP_NAMESPACE), STEP_LABELS)
    if overlay == "kfp":
        steps.append(kfp_step)
    else:
        assert not admits(rules, retriever, kfp_step)
    for step in steps:
        assert admits(rules, retriever, step), step
        assert sends(rules, step, target, PORT), step
    refused = [
        (trace_ns, trace_labels, {}),  # any other pod of trace-rl
        (trace_ns, trace_labels, {"app.kubernetes.io/name": "trace-store"}),
        (KFP_NAMESPACE, namespace_labels(KFP_NAMESPACE), {"app": "ml-pipeline-ui"}),
        ("other", namespace_labels("other"), {"ray.io/cluster": "trace-rl"}),
        ("other", namespace_labels("other"), STEP_LABELS),
    ]
    for source in refused:
        assert not admits(rules, retriever, source), source


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_retriever_reaches_only_dns_and_its_store(built: render.Builds, overlay: str) -> None:
    rules = policies(built, overlay)
    trace_ns, trace_labels = trace_namespace(built, overlay)
    source = (trace_ns, trace_labels, pod_labels(built, overlay))
    policy = one(rules, "NetworkPolicy", "trace-retriever")["spec"]
    assert "Egress" in policy["policyTypes"]
    dns, *others = policy["egress"]
    assert dns == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    assert len(others) == 1 and others[0]["to"], others  # the store, nothing else
    if overlay == "kfp":
        store = (KFP_NAMESPACE, namespace_labels(KFP_NAMESPACE), dict(SEAWEEDFS.pod_labels))
        port = SEAWEEDFS.pod_port
    else:
        template = one(built[overlay], "Deployment", "trace-store")["spec"]["template"]
        (weed,) = template["spec"]["containers"]
        port = {p["name"]: p["containerPort"] for p in weed["ports"]}["s3"]
        store = (trace_ns, trace_labels, template["metadata"]["labels"])
        # and the store admits it (under KFP: test_kfp_store.py, per release)
        assert admits(rules, (trace_ns, store[2], port), source)
    assert sends(rules, source, store, port)
    assert not sends(rules, source, store, port + 1)
    ray = (trace_ns, trace_labels, {"ray.io/cluster": "trace-rl", "ray.io/node-type": "head"})
    for other in (ray, ("web", namespace_labels("web"), {}), (*store[:2], {"app": "x"})):
        assert not sends(rules, source, other, port), other
