"""The project's image references come from one setting: components/images.env.

Everything that names the trace or trace-gpu image must name exactly what images.env says:
the KFP components and pipelines (their Python and the compiled YAML), the manifests (tracked
files and every built overlay), the Makefile (``make images push``) and the README. A literal
reference anywhere else that differs (another tag, another registry) fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support import render
from support.repo_copy import repository_copy

REPO = Path(__file__).resolve().parents[2]
IMAGES_ENV = REPO / "components" / "images.env"
NAMES = {"trace": "TRACE_IMAGE", "trace-gpu": "TRACE_GPU_IMAGE"}
# registry/path/trace[-gpu] with a tag or a digest: what a pod or a build would pull.
REFERENCE = re.compile(
    r"(?<![\w./-])(?:[a-z0-9][a-z0-9.-]*(?::\d+)?/)(?:[a-z0-9._-]+/)*(?P<name>trace(?:-gpu)?)"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?(?![\w./-])"
)
SCANNED = ("components", "pipelines", "manifests", "images", "docs", "Makefile", "README.md")
SUFFIXES = {".py", ".yaml", ".yml", ".json", ".md", ".env", ".txt", ""}


def read_env() -> dict[str, str]:
    values = {}
    for line in IMAGES_ENV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = REPO / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
            ]
    return sorted(files)


def references(text: str) -> list[tuple[str, str]]:
    """(trace or trace-gpu, the whole reference) for each image reference in ``text``."""
    return [(m["name"], m[0]) for m in REFERENCE.finditer(text) if ":" in m[0].split("/")[-1]]


def assert_is_the_setting(name: str, reference: str, where: str, tag_only: bool = False) -> None:
    """``reference`` is images.env's; with ``tag_only``, a reference without a digest may also be
    the tag of the one images.env pins (``make push``)."""
    env = read_env()
    expected = env[NAMES[name]]
    if tag_only and "@" not in reference:
        expected = expected.partition("@")[0]
    assert reference == expected, (
        f"{where}: {reference} differs from {NAMES[name]}={expected} (components/images.env)"
    )


def test_the_setting() -> None:
    env = read_env()
    assert set(env) == set(NAMES.values())
    for name, variable in NAMES.items():
        found = references(env[variable])
        assert found == [(name, env[variable])], f"{variable}={env[variable]}: not a tagged image"


def test_the_pattern_finds_references() -> None:
    text = "a ghcr.io/trace-rl/trace:0.1.0 b registry:5000/x/trace-gpu:1@sha256:" + "0" * 64
    assert references(text) == [
        ("trace", "ghcr.io/trace-rl/trace:0.1.0"),
        ("trace-gpu", "registry:5000/x/trace-gpu:1@sha256:" + "0" * 64),
    ]
    assert references("images/trace/Dockerfile trace-rl/trace-rl:1 trace:1") == []


def test_every_literal_reference_is_the_setting() -> None:
    """Whatever exists of components/, pipelines/ (with the compiled YAML), manifests/, images/,
    the Makefile and the README."""
    found = 0
    for path in scanned_files():
        if path == IMAGES_ENV:
            continue
        for name, reference in references(path.read_text(errors="replace")):
            # Where images.env pins a digest, prose and examples may name the tag alone; what
            # `make manifests` writes is checked to be pinned by the tests below and
            # tests/pipelines (the component, the compiled pipeline, the Argo manifests).
            where = str(path.relative_to(REPO))
            assert_is_the_setting(name, reference, where, tag_only=True)
            found += 1
    assert found, "no image reference found outside images.env (the README names both)"


def test_the_kustomize_component_is_the_setting() -> None:
    component = yaml.safe_load((REPO / "manifests" / "images" / "kustomization.yaml").read_text())
    assert {i["name"] for i in component["images"]} == set(NAMES)
    for image in component["images"]:
        reference = f"{image['newName']}:{image['newTag']}"
        reference += f"@{image['digest']}" if "digest" in image else ""  # pinned by make push
        assert_is_the_setting(image["name"], reference, "manifests/images/kustomization.yaml")


def test_the_kustomize_component_is_what_make_manifests_writes() -> None:
    from components.images import read_images
    from pipelines.regenerate import IMAGES_COMPONENT, images_component

    assert IMAGES_COMPONENT.read_text() == images_component(read_images()), (
        "manifests/images/kustomization.yaml is stale: run `make manifests`"
    )


def test_split_reference() -> None:
    from pipelines.regenerate import split_reference

    digest = "sha256:" + "0" * 64
    assert split_reference("registry:5000/x/trace:1.2") == {
        "newName": "registry:5000/x/trace",
        "newTag": "1.2",
    }
    assert split_reference(f"registry:5000/x/trace-gpu@{digest}") == {
        "newName": "registry:5000/x/trace-gpu",
        "digest": digest,
    }


@pytest.mark.slow
def test_make_manifests_moves_every_reference(tmp_path: Path) -> None:
    """The one place and the one command: a new registry and tag in components/images.env, then
    `make manifests`; the kustomize component, the compiled pipeline, the Argo manifests and
    every built overlay name the new references, and nothing names the old ones."""
    repo = repository_copy(tmp_path / "repo")
    old = read_env()
    new = {
        "TRACE_IMAGE": "registry.corp:5000/ml/trace:2.0.0",
        "TRACE_GPU_IMAGE": "registry.corp:5000/ml/trace-gpu:2.0.0",
    }
    env_file = repo / "components" / "images.env"
    text = env_file.read_text()
    for variable, reference in new.items():
        text = text.replace(f"{variable}={old[variable]}", f"{variable}={reference}")
    env_file.write_text(text)

    done = subprocess.run(
        ["make", "--no-print-directory", "manifests"],
        cwd=repo, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    generated = [
        repo / "manifests" / "images" / "kustomization.yaml",
        repo / "pipelines" / "compiled" / "trace_training.yaml",
        repo / "manifests" / "argo" / "workflowtemplate.yaml",
    ]
    for path in generated:
        found = {reference for _, reference in references(path.read_text())}
        if path.name == "kustomization.yaml":
            component = yaml.safe_load(path.read_text())
            found = {f"{i['newName']}:{i['newTag']}" for i in component["images"]}
        assert found == set(new.values()), path
    for example in (repo / "manifests").rglob("*.env.example"):  # the untracked Secret files
        shutil.copyfile(example, example.with_suffix(""))
    objects = render.kustomize(repo / "manifests" / "overlays" / "standalone")
    images = set(container_images(objects))
    assert set(new.values()) <= images and not images & set(old.values()), images


def test_the_pull_secret_component_reaches_every_pod(tmp_path: Path) -> None:
    """manifests/pull-secret added to an overlay: every ServiceAccount pulls with
    trace-registry, and every pod that runs one of the project's images runs as one of them."""
    root = render.copy_manifests(tmp_path)
    overlay = root / "overlays" / "standalone" / "kustomization.yaml"
    body = yaml.safe_load(overlay.read_text())
    body["components"] = [*body["components"], "../../pull-secret"]
    overlay.write_text(yaml.safe_dump(body))
    objects = render.kustomize(overlay.parent)
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    assert accounts
    for name, account in accounts.items():
        assert account.get("imagePullSecrets") == [{"name": "trace-registry"}], name
    pods = [
        pod
        for obj in objects
        for pod in render.pod_templates(obj)
        if any(
            image.rsplit("/", 1)[-1].split(":")[0] in NAMES for image in container_images(pod.spec)
        )
    ]
    assert len(pods) > 3
    for pod in pods:
        assert pod.spec.get("serviceAccountName") in accounts, pod.source


def container_images(node: object) -> list[str]:
    """Every ``image`` of a container (or of KubeRay's autoscaler options) below ``node``."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("image"), str):
            found.append(node["image"])
        for child in node.values():
            found += container_images(child)
    elif isinstance(node, list):
        for child in node:
            found += container_images(child)
    return found


@pytest.mark.parametrize("overlay", ["kfp", "standalone", "dev"])
def test_built_overlays_pull_the_setting(tmp_path: Path, overlay: str) -> None:
    objects = render.build_all(tmp_path)[overlay]
    images = container_images(objects)
    ours = [i for i in images if i.rsplit("/", 1)[-1].split(":")[0].split("@")[0] in NAMES]
    assert ours, f"{overlay}: no trace image in the build"
    for image in ours:
        name = image.rsplit("/", 1)[-1].split(":")[0].split("@")[0]
        assert_is_the_setting(name, image, f"kubectl kustomize manifests/overlays/{overlay}")


def test_make_images_reads_the_setting() -> None:
    """`make images push` builds and pushes the tags of the setting (``make -n``: the commands
    it would run with docker), and without a container engine fails, naming what it cannot run."""

    def make(*args: str) -> subprocess.CompletedProcess[str]:
        command = ["make", "--no-print-directory", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    planned = make("-n", "images", "push", "IMAGE_TOOL=docker")
    assert planned.returncode == 0, planned.stderr
    env = {k: v.partition("@")[0] for k, v in read_env().items()}  # a pinned digest's tag
    for variable, dockerfile in (
        ("TRACE_IMAGE", "images/trace/Dockerfile"),
        ("TRACE_GPU_IMAGE", "images/trace-gpu/Dockerfile"),
    ):
        assert f"docker build -f {dockerfile} -t {env[variable]} ." in planned.stdout
        assert f"docker push {env[variable]}" in planned.stdout
    done = make("images", "push", "IMAGE_TOOL=")
    assert done.returncode != 0
    assert (
        "no container engine (docker info failed, no buildah): cannot run docker build -f "
        f"images/trace/Dockerfile -t {env['TRACE_IMAGE']} ." in done.stderr
    )
