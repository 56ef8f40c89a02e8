"""A cluster rehearsal from what ships: the committed compiled pipeline run against a Ray cluster
started from the rendered kfp overlay, with token auth, on one machine.

    make rehearse                        # = python -m pipelines.rehearse --output build/rehearsal
    python -m pipelines.rehearse --compiled my.yaml --output build/r   # another compiled file

What it reads, and never repeats by hand:
- ``manifests/overlays/kfp`` rendered (``kubectl kustomize``): the RayCluster's head and its
  first GPU worker group give the ``ray start`` flags (their ``rayStartParams``) and each node's
  environment: its container's ``env`` (ConfigMap keys from the rendered ConfigMaps, Secret keys
  from the rehearsal's Secrets), and what KubeRay's ``authOptions: {mode: token}`` adds to every
  Ray container (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN`` from the Secret it names).
- ``pipelines/compiled/trace_training.yaml``: every task, run by KFP's local runner from that
  file, with its executor's command, arguments and ``env``, and the variables the Kubernetes
  platform spec fills from Secrets (``secretAsEnv``, the Secret's name resolved from the run's
  parameters as KFP's driver does) added to that executor alone.

On one machine: a SeaweedFS on 127.0.0.1 at the port KFP's store serves (8333), with KFP's
bucket; the head and one worker node on 127.0.0.1; two iterations of the tiny calc policy, then
the exit handler. What the files ask that one machine cannot honour is printed, one line each,
before anything runs (``Rehearsal.unhonoured``): GPUs, node placement, pod resources, the
cluster's DNS names, the images (the steps run in this environment). Exit 0 when every task
succeeded and the exit handler released the session; otherwise 1 and the failing step's output.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.cluster_check import render_overlay
from pipelines.ray_head import START_ATTEMPTS, free_port, stop_head
from pipelines.trace_training import COMPILED

KFP_STORE_PORT = 8333
"""Where KFP's SeaweedFS serves S3 (``components.cluster``): the rehearsal's store port too."""
SETTINGS = {"warmstart_steps": 20, "prompts": 16, "eval_tasks": 8, "eval_k": 1, "max_tokens": 16}
"""The tiny calc run: what matters here is that every step runs, not what it learns."""
ACCESS_KEY, SECRET_KEY_VALUE = "rehearsal-key", "rehearsal-secret"  # a loopback server's
PIPELINE_CHANNEL = "pipelinechannel--"
READY_S = 120.0
OBJECT_STORE_CAP = 1_000_000_000
"""A node's object store here at most (the GPU pods' is sized for their /dev/shm)."""

Manifest = dict[str, Any]


# --- the manifests ----------------------------------------------------------------------------
def _one(objects: list[Manifest], kind: str) -> Manifest:
    found = [obj for obj in objects if obj.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"the rendered overlay holds {len(found)} {kind} objects, expected 1")
    return found[0]


def config_maps(objects: list[Manifest]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


@dataclass
class Rehearsal:
    """What the run needs, gathered before anything starts; ``unhonoured``: one line each."""

    token: str
    store_port: int = KFP_STORE_PORT
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rehearse-")))
    unhonoured: list[str] = field(default_factory=list)
    dropped: tuple[str, ...] = ()
    """Variables taken out of every executor's environment (``--drop-env``): what a compiled
    pipeline without them would do, e.g. RAY_AUTH_MODE."""

    def secrets(self) -> dict[str, dict[str, str]]:
        """The cluster's Secrets by name, as ``manifests/secrets`` and KFP make them."""
        s3 = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY_VALUE}
        return {
            "trace-s3": s3,  # manifests/secrets/s3 (the Ray pods')
            "mlpipeline-minio-artifact": {"accesskey": ACCESS_KEY, "secretkey": SECRET_KEY_VALUE},
            "trace-ray-auth": {"auth_token": self.token},  # manifests/secrets/ray-auth
        }

    def local_url(self, value: str, what: str) -> str:
        """A cluster DNS name in ``value`` pointed at 127.0.0.1, the port kept (and listed)."""
        match = re.fullmatch(r"(https?://)([^/:]+\.svc(?:\.cluster\.local)?)(:\d+)?(/.*)?", value)
        if not match:
            return value
        self.unhonoured.append(f"{what}: {match[2]} is 127.0.0.1 here (port kept)")
        return f"{match[1]}127.0.0.1{match[3] or ''}{match[4] or ''}"

    def node_env(
        self,
        container: Manifest,
        auth: Manifest,
        maps: Mapping[str, Mapping[str, str]],
        where: str,
    ) -> dict[str, str]:
        """A Ray container's environment: its ``env`` resolved, then what KubeRay's
        authOptions add; values under the pod's volume mounts move into this run's folder."""
        held = self.secrets()
        env: dict[str, str] = {}
        for item in container.get("env", []):
            name, source = item["name"], item.get("valueFrom")
            if source is None:
                value = str(item.get("value", ""))
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
                ref = source[kind]
                found = (maps if kind == "configMapKeyRef" else held).get(ref["name"], {})
                if ref["key"] not in found and ref.get("optional"):
                    continue  # as the kubelet does: an optional key that is not there is unset
                value = found[ref["key"]]
            else:
                self.unhonoured.append(f"{where}: env {name} from {sorted(source)} is not set")
                continue
            env[name] = self.local_url(value, f"{where}: env {name}")
        for mount in container.get("volumeMounts", []):
            for name, value in env.items():
                if value.startswith(mount["mountPath"] + "/") or value == mount["mountPath"]:
                    moved = str(self.work / where.replace(" ", "-")) + value
                    env[name] = moved
                    self.unhonoured.append(f"{where}: env {name} {value} is under {moved}")
        if auth.get("mode") == "token":  # KubeRay puts these into every Ray container
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN"] = held[auth.get("secretName", "")]["auth_token"]
        return env

    def start_flags(self, params: Mapping[str, Any], resources: Manifest, where: str) -> list[str]:
        """``rayStartParams`` as ``ray start`` flags; what KubeRay derives from the container's
        limits (CPUs, GPUs, memory) is listed instead where this machine cannot give it."""
        flags = []
        for name, value in params.items():
            if name == "dashboard-host":
                self.unhonoured.append(f"{where}: dashboard-host {value} is 127.0.0.1 here")
                value = "127.0.0.1"
            if name == "object-store-memory" and int(value) > OBJECT_STORE_CAP:
                self.unhonoured.append(
                    f"{where}: object-store-memory {value} is {OBJECT_STORE_CAP} here"
                )
                value = str(OBJECT_STORE_CAP)
            flags.append(f"--{name}={value}")
        limits = resources.get("limits", {})
        if "num-cpus" not in params:
            cpus = max(4, os.cpu_count() or 1)
            flags.append(f"--num-cpus={cpus}")
            self.unhonoured.append(f"{where}: cpu {limits.get('cpu', '?')} is {cpus} CPUs here")
        gpus = {k: v for k, v in limits.items() if k.endswith("/gpu")}
        if "num-gpus" not in params:
            flags.append("--num-gpus=0")
            if gpus:
                self.unhonoured.append(f"{where}: {gpus} is no GPU here (CPU engines, trainers)")
        for name in ("memory", "ephemeral-storage"):
            if name in limits:
                self.unhonoured.append(f"{where}: {name} {limits[name]} is not enforced here")
        return flags


# --- the Ray cluster --------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    address: str
    dashboard_url: str


@contextlib.contextmanager
def ray_cluster(rehearsal: Rehearsal, objects: list[Manifest]) -> Iterator[Cluster]:
    """The overlay's RayCluster on 127.0.0.1: its head, and one node of its first worker group
    (the GPU group, without GPUs), each with its group's flags and environment."""
    cluster = _one(objects, "RayCluster")
    spec = cluster["spec"]
    auth, maps = spec.get("authOptions", {}), config_maps(objects)
    ray = str(Path(sys.executable).parent / "ray")
    port, dashboard = free_port(), free_port()
    head_spec = spec["headGroupSpec"]
    (head_container,) = [
        c for c in head_spec["template"]["spec"]["containers"] if c["name"] == "ray-head"
    ]
    head_env = rehearsal.node_env(head_container, auth, maps, "head")
    head_flags = rehearsal.start_flags(
        head_spec.get("rayStartParams", {}), head_container.get("resources", {}), "head"
    )
    group = spec["workerGroupSpecs"][0]
    worker_container = group["template"]["spec"]["containers"][0]
    where = f"worker group {group['groupName']}"
    worker_env = rehearsal.node_env(worker_container, auth, maps, where)
    worker_flags = rehearsal.start_flags(
        group.get("rayStartParams", {}), worker_container.get("resources", {}), where
    )
    for path in [*head_env.values(), *worker_env.values()]:
        if path.startswith(str(rehearsal.work)):
            Path(path).mkdir(parents=True, exist_ok=True)
    bin_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block"]
    started: list[tuple[subprocess.Popen[bytes], str]] = []

    def start(flags: list[str], env: dict[str, str], name: str) -> None:
        temp = tempfile.mkdtemp(prefix=f"rr{name[0]}", dir="/tmp")  # socket paths <= 107 bytes
        log = (rehearsal.work / f"ray-{name}.log").open("w")
        process = subprocess.Popen(
            [
                ray,
                "start",
                *flags,
                *common,
                f"--temp-dir={temp}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
            ],
            env={**os.environ, **env, "PATH": bin_path},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        started.append((process, temp))

    url = f"http://127.0.0.1:{dashboard}"
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                start(
                    [
                        "--head",
                        f"--port={port}",
                        f"--dashboard-port={dashboard}",
                        f"--ray-client-server-port={free_port()}",
                        *head_flags,
                    ],
                    head_env,
                    "head",
                )
                _wait(url + "/api/version", rehearsal.token, started[0][0], "the Ray head")
                start([f"--address=127.0.0.1:{port}", *worker_flags], worker_env, "worker")
                _wait_nodes(url, rehearsal.token, 2, started)
                break
            except NodeExited as error:  # Ray gives a raylet 30 s to register, busy or not
                if attempt == START_ATTEMPTS:
                    raise
                print(f"{error} (see {rehearsal.work}/ray-*.log); starting the cluster again")
                while started:
                    stop_head(*started.pop())
                port, dashboard = free_port(), free_port()
                url = f"http://127.0.0.1:{dashboard}"
        yield Cluster(f"127.0.0.1:{port}", url)
    finally:
        for process, temp in reversed(started):
            stop_head(process, temp)


class NodeExited(RuntimeError):
    """A ``ray start`` process ended while its node was starting."""


def _get(url: str, token: str) -> bytes | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=2) as response:
        return bytes(response.read()) if response.status == 200 else None
    return None


def _wait(url: str, token: str, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + READY_S
    while _get(url, token) is None:
        if process.poll() is not None:
            raise NodeExited(f"{what} exited ({process.returncode}) before it answered")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} in {READY_S:g} s")
        time.sleep(0.5)


def _wait_nodes(url: str, token: str, count: int, started: list[Any]) -> None:
    """Until the head lists ``count`` live nodes (the worker joined)."""
    deadline = time.monotonic() + READY_S
    while True:
        body = _get(url + "/nodes?view=summary", token)
        if body is not None:
            nodes = json.loads(body).get("data", {}).get("summary", [])
            if sum(1 for node in nodes if node.get("raylet", {}).get("state") == "ALIVE") >= count:
                return
        for process, _ in started:
            if process.poll() is not None:
                raise NodeExited(f"a Ray node exited ({process.returncode}) while joining")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray cluster did not reach {count} nodes in {READY_S:g} s")
        time.sleep(1.0)


# --- the compiled pipeline --------------------------------------------------------------------
def executor_env(
    rehearsal: Rehearsal, documents: list[Manifest], arguments: Mapping[str, Any]
) -> list[Manifest]:
    """The compiled documents with each executor's ``secretAsEnv`` (platform spec) resolved
    into its container's ``env``, cluster names pointed here, and what one machine cannot
    honour (resources, node placement) taken out and listed. Returns the pipeline document."""
    pipeline, platform = copy.deepcopy(documents[0]), documents[1]
    defaults = {
        name: spec.get("defaultValue")
        for name, spec in pipeline["root"]["inputDefinitions"]["parameters"].items()
    }
    values = {**defaults, **arguments}
    held = rehearsal.secrets()
    kubernetes = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, executor in pipeline["deploymentSpec"]["executors"].items():
        container = executor["container"]
        env = container.setdefault("env", [])
        for item in env:
            item["value"] = rehearsal.local_url(item["value"], f"{name}: env {item['name']}")
        config = kubernetes.get(name, {})
        for secret in config.get("secretAsEnv", []):
            secret_name = (
                secret.get("secretName")
                or values[
                    secret["secretNameParameter"]["componentInputParameter"].removeprefix(
                        PIPELINE_CHANNEL
                    )
                ]
            )
            if secret_name not in held:
                if not secret.get("optional"):
                    raise ValueError(f"{name}: Secret {secret_name!r} is not one the cluster has")
                continue
            for item in secret["keyToEnv"]:
                env.append({"name": item["envVar"], "value": held[secret_name][item["secretKey"]]})
        env[:] = [item for item in env if item["name"] not in rehearsal.dropped]
        for key in ("nodeSelector", "nodeAffinity", "tolerations", "imagePullSecret"):
            if config.get(key):
                rehearsal.unhonoured.append(f"{name}: {key} is not applied on one machine")
        if container.pop("resources", None):
            rehearsal.unhonoured.append(f"{name}: pod resources (requests, limits, GPUs) unset")
        rehearsal.unhonoured.append(f"{name}: image {container['image']} is this environment")
    _drop_gpu_requests(rehearsal, pipeline)
    return [pipeline]


def _drop_gpu_requests(rehearsal: Rehearsal, pipeline: Manifest) -> None:
    """The tasks' GPU request (``accelerator_count``/``accelerator_type``, run parameters that
    KFP's driver resolves into the pod's limits) and the inputs that carry only them: KFP's
    local runner cannot resolve run parameters there, and no GPU is here."""
    for component in [pipeline["root"], *pipeline["components"].values()]:
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            parameters = task.get("inputs", {}).get("parameters", {})
            carried = set()
            for key in ("accelerator_count", "accelerator_type"):
                request = parameters.pop(key, None)
                if request is not None:
                    constant = json.dumps(request)
                    carried |= set(re.findall(rf"{PIPELINE_CHANNEL}[\w-]+", constant))
            for channel in carried:  # unless another of the task's inputs reads it too
                others = {k: v for k, v in parameters.items() if k != channel}
                if channel not in json.dumps(others):
                    parameters.pop(channel, None)
            if carried:
                rehearsal.unhonoured.append(f"task {task_name}: its GPU request is not made")


def run_pipeline(pipeline: Manifest, arguments: Mapping[str, Any], root: Path) -> None:
    """The pipeline document (``executor_env``'s) through KFP's local runner; raises when a
    task fails (its output is in the log)."""
    from kfp import components, local

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(root / "kfp"),
        workspace_root=str(root / "workspace"),
        raise_on_error=True,
    )
    component = components.load_component_from_text(yaml.safe_dump(pipeline, sort_keys=False))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*have no effect in the current local runner")
        warnings.filterwarnings("ignore", "You may be attemping to run a task")
        component(**arguments)


def released(root: Path) -> str:
    """What the exit handler's task returned (its executor output), or '' if it did not run."""
    for output in (root / "kfp").glob("*/release-session/executor_output.json"):
        body = json.loads(output.read_text())
        return str(body.get("parameterValues", {}).get("Output", ""))
    return ""


def rehearse(compiled: Path, output: Path, say: Any = print, drop_env: tuple[str, ...] = ()) -> int:
    """The whole rehearsal (module docstring); its exit code. ``drop_env``: variables taken
    out of every executor first (``Rehearsal.dropped``)."""
    from trace_core.store.server import SeaweedServer

    output.mkdir(parents=True, exist_ok=True)
    rehearsal = Rehearsal(
        token=secrets.token_hex(32), work=Path(tempfile.mkdtemp(dir=output)), dropped=drop_env
    )
    for name in drop_env:
        say(f"taken out of every step's environment: {name}")
    objects = render_overlay("kfp")
    arguments: dict[str, Any] = {
        "iterations": 2,
        "budget": 8,
        "settings_json": json.dumps(SETTINGS),
        "run_name": "rehearsal",
    }
    with contextlib.ExitStack() as stack:
        store = SeaweedServer.start(
            rehearsal.work / "seaweedfs",
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY_VALUE,
            buckets=("mlpipeline",),
            s3_port=rehearsal.store_port,
        )
        stack.callback(store.stop)
        cluster = stack.enter_context(ray_cluster(rehearsal, objects))
        documents = list(yaml.safe_load_all(compiled.read_text()))
        default_jobs = documents[0]["root"]["inputDefinitions"]["parameters"]["ray_jobs_url"]
        arguments["ray_jobs_url"] = cluster.dashboard_url
        rehearsal.unhonoured.append(
            f"run parameter ray_jobs_url: {default_jobs.get('defaultValue')} is "
            f"{cluster.dashboard_url} here"
        )
        rehearsal.unhonoured.append("KFP's artifacts: a local folder here, not the store")
        (pipeline,) = executor_env(rehearsal, documents, arguments)
        # The steps start without the Ray and S3 variables of this process: only what their
        # executors declare reaches them.
        for name in [n for n in os.environ if n.startswith(("RAY_AUTH", "AWS_", "S3_"))]:
            stack.enter_context(_unset(name))
        for line in dict.fromkeys(rehearsal.unhonoured):
            say(f"not honoured here: {line}")
        say(f"Ray cluster {cluster.address} (token auth), store 127.0.0.1:{rehearsal.store_port}")
        try:
            run_pipeline(pipeline, arguments, output)
        except Exception as error:  # a failed task: kfp.local names it; its output is above
            say(f"rehearsal failed: {' '.join(str(error).split())[:2000]}")
            return 1
    what = released(output)
    say(f"exit handler: {what or 'nothing released'}")
    say("rehearsal passed: every task of the compiled pipeline ran against token auth")
    return 0


@contextlib.contextmanager
def _unset(name: str) -> Iterator[None]:
    saved = os.environ.pop(name)
    try:
        yield
    finally:
        os.environ[name] = saved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.rehearse", description=__doc__)
    parser.add_argument("--compiled", type=Path, default=COMPILED, help="the compiled pipeline")
    parser.add_argument("--output", type=Path, default=Path("build/rehearsal"))
    parser.add_argument(
        "--drop-env",
        action="append",
        default=[],
        metavar="NAME",
        help="take NAME out of every step's environment (what the compiled pipeline would do "
        "without it: --drop-env RAY_AUTH_MODE must fail); repeat for more",
    )
    args = parser.parse_args(argv)
    if not args.compiled.is_file():
        print(f"error: --compiled {args.compiled}: no such file", file=sys.stderr)
        return 2
    return rehearse(args.compiled, args.output, drop_env=tuple(args.drop_env))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
