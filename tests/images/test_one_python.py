"""One Python and one Ray wherever a process talks to the Ray cluster: Ray refuses a worker or a
driver whose Python minor version or Ray version is not the head's.

Those processes: every pod of every overlay's RayCluster (head, workers, the autoscaler sidecar,
which runs the head's image), and the pipeline steps that use Ray (``RAY_STEPS`` of
``trace_core.train.contract``, and the exit handler that releases a run's jobs and actors), as
the compiled KFP package, the KFP components and the Argo WorkflowTemplate run them.

An image's Python is the one its Dockerfile asserts at build time (``RUN python -c "import sys;
assert sys.version_info[:2] == (3, 12), ..."``), its Ray the lock's (requirements/constraints.txt)
unless the image's overrides.txt names another; the RayCluster's ``rayVersion`` must be that Ray.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.utils import canonicalize_name
from support import render
from support.image_requirements import IMAGES

import components
from components.images import read_images
from pipelines.trace_training import COMPILED
from trace_core.train.contract import RAY_STEPS

REPO = render.REPO
DOCKERFILES = {
    "TRACE_IMAGE": REPO / "images" / "trace" / "Dockerfile",
    "TRACE_GPU_IMAGE": REPO / "images" / "trace-gpu" / "Dockerfile",
}
RAY_CLIENTS = (*RAY_STEPS, "release-session")
"""The pipeline's steps that talk to Ray (components/release_session.py: the exit handler)."""
ASSERTED = re.compile(r"sys\.version_info\[:2\] == \((\d+), (\d+)\)")


def python_of(dockerfile: Path) -> tuple[int, int]:
    """The Python minor version the Dockerfile's build asserts (one RUN line says it)."""
    found = {
        (int(m[1]), int(m[2]))
        for line in dockerfile.read_text().splitlines()
        if not line.lstrip().startswith("#")
        for m in ASSERTED.finditer(line)
    }
    assert len(found) == 1, f"{dockerfile}: asserts the Python version {len(found)} times"
    return found.pop()


def ray_of(dockerfile: Path) -> str:
    """The Ray release the image installs: the lock's, or its overrides.txt's."""
    pins = {}
    for path in (REPO / "requirements" / "constraints.txt", dockerfile.with_name("overrides.txt")):
        if path.is_file():
            for raw in path.read_text().splitlines():
                name, sep, version = raw.split("#", 1)[0].strip().partition("==")
                if sep:
                    pins[canonicalize_name(name)] = version
    return pins["ray"]


def image_name(reference: str) -> str:
    """components/images.env's name of an image reference (TRACE_IMAGE, TRACE_GPU_IMAGE)."""
    names = {ref: name for name, ref in read_images().items()}
    assert reference in names, f"{reference} is not an image of components/images.env"
    return names[reference]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> render.Builds:
    return render.build_all(tmp_path_factory.mktemp("manifests"))


def ray_clients(built: render.Builds) -> dict[str, str]:
    """Where a process talks to the Ray cluster → the image it runs (a reference)."""
    clients = {}
    for overlay in render.OVERLAYS:
        for obj in built[overlay]:
            if obj["kind"] == "RayCluster":
                for template in render.pod_templates(obj):
                    for container in template.spec["containers"]:
                        clients[f"{overlay}: {template.source}, {container['name']}"] = container[
                            "image"
                        ]
                image = obj["spec"].get("autoscalerOptions", {}).get("image")
                if image:
                    clients[f"{overlay}: {render.name_of(obj)}, autoscaler"] = image
            if obj["kind"] in render.ARGO_KINDS:
                for template in render.pod_templates(obj):
                    (container,) = template.spec["containers"]
                    args = container.get("args") or []
                    if args[:1] == ["step"] and args[1] in RAY_CLIENTS:
                        clients[f"{overlay}: {template.source}"] = container["image"]
    pipeline, _ = yaml.safe_load_all(COMPILED.read_text())
    for executor, spec in pipeline["deploymentSpec"]["executors"].items():
        step = re.sub(r"-\d+$", "", executor.removeprefix("exec-"))
        if step in RAY_CLIENTS:
            clients[f"{COMPILED.name}: {executor}"] = spec["container"]["image"]
    for name in components.__all__:
        if name.replace("_", "-") in RAY_CLIENTS:
            component: Any = getattr(components, name)
            image = component.component_spec.implementation.container.image
            clients[f"components.{name}"] = image
    return clients


def test_every_ray_client_runs_one_python_and_one_ray(built: render.Builds) -> None:
    clients = ray_clients(built)
    # Each overlay's head and workers, and each Ray step in the package and the components.
    for overlay in render.OVERLAYS:
        pods = [w for w in clients if w.startswith(f"{overlay}: RayCluster")]
        assert any(w.endswith(", head, ray-head") for w in pods) and len(pods) >= 2, overlay
    for step in RAY_CLIENTS:
        assert f"components.{step.replace('-', '_')}" in clients, step
    for step in RAY_STEPS:
        assert any(f"exec-{step}" in where for where in clients), step
    versions = {}
    for where, reference in clients.items():
        dockerfile = DOCKERFILES[image_name(reference)]
        versions[where] = (python_of(dockerfile), ray_of(dockerfile))
    cluster_python, cluster_ray = versions["kfp: RayCluster trace-rl/trace-rl, head, ray-head"]
    wrong = [
        f"{where}: Python {p[0]}.{p[1]}, Ray {r}"
        for where, (p, r) in sorted(versions.items())
        if (p, r) != (cluster_python, cluster_ray)
    ]
    assert wrong == [], f"the Ray head has Python {cluster_python}, Ray {cluster_ray}"
    for overlay in render.OVERLAYS:
        (cluster,) = [o for o in built[overlay] if o["kind"] == "RayCluster"]
        assert cluster["spec"]["rayVersion"] == cluster_ray, overlay


def test_each_image_states_its_python_once() -> None:
    """The Dockerfiles' assertions are the versions the requirement checks resolve wheels for
    (tests/support/image_requirements.py), and the CPU image's is its base image's tag."""
    by_dockerfile = {image.dockerfile: image.python for image in IMAGES.values()}
    for dockerfile in DOCKERFILES.values():
        assert python_of(dockerfile) == by_dockerfile[dockerfile], dockerfile
    cpu = DOCKERFILES["TRACE_IMAGE"]
    tags = re.findall(r"^FROM docker\.io/library/python:(\d+)\.(\d+)\.", cpu.read_text(), re.M)
    assert {(int(a), int(b)) for a, b in tags} == {python_of(cpu)}
    assert python_of(DOCKERFILES["TRACE_GPU_IMAGE"]) != python_of(cpu)  # why this test exists


def test_a_second_python_is_named(tmp_path: Path) -> None:
    twice = tmp_path / "Dockerfile"
    twice.write_text(
        'RUN python -c "import sys; assert sys.version_info[:2] == (3, 11)"\n'
        'RUN python -c "import sys; assert sys.version_info[:2] == (3, 12)"\n'
    )
    with pytest.raises(AssertionError, match="2 times"):
        python_of(twice)
