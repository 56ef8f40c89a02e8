"""`make push` pins each pushed image's digest in components/images.env, and `make manifests`
writes the pinned references everywhere (``pipelines.digests``, ``pipelines.regenerate``).

No container engine runs here: what docker and buildah write is written by hand in the forms
they write it (buildah's ``--digestfile``: ``sha256:<hex>``; docker's ``RepoDigests`` as
JSON), and the Makefile's recipe is read with ``make -n``. The committed files are never
rewritten: the end-to-end test runs in a copy of the repository, with made-up digests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import render
from support.repo_copy import repository_copy

from pipelines.digests import parse_digest, pin, record, repository_of, tag_of

REPO = Path(__file__).resolve().parents[2]
CPU, GPU = "sha256:" + "a" * 64, "sha256:" + "b" * 64
IMAGES = """\
# the project's images
TRACE_IMAGE=registry.example.com:5000/ml/trace:0.2.0
TRACE_GPU_IMAGE=registry.example.com:5000/ml/trace-gpu:0.2.0@sha256:{old}
""".format(old="0" * 64)


def test_buildahs_digest_file() -> None:
    assert parse_digest(f"{CPU}\n", "r.io/ml/trace:1") == CPU
    assert parse_digest(CPU, "r.io/ml/trace:1@" + GPU) == CPU  # the file's, not the old pin


def test_dockers_repo_digests_give_the_references_repository() -> None:
    """One entry per repository the image has been pushed to or pulled from; Docker Hub's
    names without their implicit docker.io/ and library/."""
    written = f'["ghcr.io/trace-rl/trace@{GPU}","registry.example.com:5000/ml/trace@{CPU}"]\n'
    assert parse_digest(written, "registry.example.com:5000/ml/trace:0.2.0") == CPU
    assert parse_digest(f'["team/trace@{CPU}"]', "docker.io/team/trace:1") == CPU
    assert parse_digest(f'["ubuntu@{CPU}"]', "docker.io/library/ubuntu:24.04") == CPU
    assert repository_of("localhost:5000/trace") == "localhost:5000/trace"  # a port, no tag


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("", "expected sha256:<64 hex>"),
        ("sha256:abc", "expected sha256:<64 hex>"),
        ("[]", "hold no digest of registry.example.com:5000/ml/trace"),
        (
            f'["ghcr.io/trace-rl/trace@{CPU}"]',
            "was registry.example.com:5000/ml/trace:0.2.0 pushed",
        ),
        ('{"RepoDigests": []}', "docker's RepoDigests as JSON"),
    ],
)
def test_what_is_not_a_digest_of_the_image_is_refused(written: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_digest(written, "registry.example.com:5000/ml/trace:0.2.0")


def test_pin_writes_the_digest_beside_the_tag() -> None:
    pinned = pin(pin(IMAGES, "TRACE_IMAGE", CPU), "TRACE_GPU_IMAGE", GPU)
    assert pinned.splitlines() == [
        "# the project's images",
        f"TRACE_IMAGE=registry.example.com:5000/ml/trace:0.2.0@{CPU}",
        f"TRACE_GPU_IMAGE=registry.example.com:5000/ml/trace-gpu:0.2.0@{GPU}",  # replaced
    ]
    assert tag_of(f"r.io/x/trace:1@{CPU}") == "r.io/x/trace:1"
    with pytest.raises(KeyError, match="no NOPE="):
        pin(IMAGES, "NOPE", CPU)


def test_record_pins_what_the_push_wrote_and_refuses_the_rest(tmp_path: Path) -> None:
    """`python -m pipelines.digests record NAME FILE`, as `make push` runs it: the file pinned;
    a file that holds no digest of the image leaves images.env as it was and fails in one line."""
    env, written = tmp_path / "images.env", tmp_path / "TRACE_IMAGE.digest"
    env.write_text(IMAGES)
    written.write_text(f'["registry.example.com:5000/ml/trace@{CPU}"]')
    assert record("TRACE_IMAGE", written, env) == f"registry.example.com:5000/ml/trace:0.2.0@{CPU}"
    assert env.read_text() == pin(IMAGES, "TRACE_IMAGE", CPU)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pipelines.digests", "record", *args]
        command += ["--images-env", str(env)]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    env.write_text(IMAGES)
    (tmp_path / "gpu.digest").write_text(GPU)
    done = run("TRACE_GPU_IMAGE", str(tmp_path / "gpu.digest"))
    assert done.returncode == 0, done.stderr
    assert f"TRACE_GPU_IMAGE=registry.example.com:5000/ml/trace-gpu:0.2.0@{GPU}" in done.stdout
    assert env.read_text() == pin(IMAGES, "TRACE_GPU_IMAGE", GPU)
    (tmp_path / "bad.digest").write_text("Error: no such image")
    for args in (("TRACE_IMAGE", str(tmp_path / "bad.digest")), ("TRACE_IMAGE", "missing")):
        failed = run(*args)
        assert failed.returncode == 1 and failed.stderr.startswith(
            f"make push: {env}, TRACE_IMAGE:"
        )
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        assert env.read_text() == pin(IMAGES, "TRACE_GPU_IMAGE", GPU)  # unchanged


@pytest.mark.parametrize("tool", ["docker", "buildah"])
def test_make_push_records_the_file_the_tool_writes(tool: str) -> None:
    """`make -n push`: each image pushed under its tag (a pinned reference's digest left off),
    the digest written to build/NAME.digest by the tool, then recorded from that file."""
    pinned = f"registry.example.com/ml/trace:0.2.0@{CPU}"
    command = ["make", "--no-print-directory", "-n", "images", "push", f"IMAGE_TOOL={tool}"]
    command.append(f"TRACE_IMAGE={pinned}")
    planned = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    tag, out = "registry.example.com/ml/trace:0.2.0", planned.stdout
    assert f"{tool} build -f images/trace/Dockerfile -t {tag} ." in out
    if tool == "buildah":
        assert f"buildah push --digestfile build/TRACE_IMAGE.digest {tag};" in out
    else:
        assert f"docker push {tag};" in out
        inspect = f"docker image inspect --format '{{{{json .RepoDigests}}}}' {tag}"
        assert f"{inspect} > build/TRACE_IMAGE.digest;" in out
    assert "-m pipelines.digests record TRACE_IMAGE build/TRACE_IMAGE.digest" in out
    assert "-m pipelines.digests record TRACE_GPU_IMAGE build/TRACE_GPU_IMAGE.digest" in out
    assert out.index(f"{tool} push") < out.index("record TRACE_IMAGE")


@pytest.mark.slow
def test_make_manifests_pins_the_recorded_digests(tmp_path: Path) -> None:
    """In a copy of the repository: both digests recorded as `make push` records them, then
    `make manifests`; the kustomize images component gets ``digest:``, the compiled pipeline,
    the Argo manifests and every built overlay name ``image:tag@sha256:...``, and `make images`
    still builds the tags."""
    repo = repository_copy(tmp_path / "repo")
    (repo / "build").mkdir(exist_ok=True)
    for name, digest in (("TRACE_IMAGE", CPU), ("TRACE_GPU_IMAGE", GPU)):
        (repo / "build" / f"{name}.digest").write_text(digest)  # as buildah writes it
        command = [sys.executable, "-m", "pipelines.digests", "record", name]
        command.append(f"build/{name}.digest")
        done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    env = dict(
        line.split("=", 1)
        for line in (repo / "components" / "images.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env["TRACE_IMAGE"].endswith(f":0.1.0@{CPU}"), env  # the committed tag, pinned
    assert env["TRACE_GPU_IMAGE"].endswith(f"@{GPU}"), env

    made = subprocess.run(
        ["make", "--no-print-directory", "manifests"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    component = yaml.safe_load((repo / "manifests" / "images" / "kustomization.yaml").read_text())
    assert {i["name"]: i.get("digest") for i in component["images"]} == {
        "trace": CPU,
        "trace-gpu": GPU,
    }
    pinned = set(env.values())
    for generated in (
        "pipelines/compiled/trace_training.yaml",
        "manifests/argo/workflowtemplate.yaml",
    ):
        text = (repo / generated).read_text()
        named = {
            line.split("image:", 1)[1].strip() for line in text.splitlines() if " image: " in line
        }
        ours = {n for n in named if "/trace" in n}
        assert ours and ours <= pinned, (generated, ours)
    for example in (repo / "manifests").rglob("*.env.example"):  # the untracked Secret files
        example.with_suffix("").write_text(example.read_text())
    objects = render.kustomize(repo / "manifests" / "overlays" / "standalone")
    text = yaml.safe_dump_all(objects)
    ours = {line.split("image:", 1)[1].strip() for line in text.splitlines() if "image: " in line}
    assert {n for n in ours if "/trace" in n} == pinned

    planned = subprocess.run(
        ["make", "--no-print-directory", "-n", "images", "IMAGE_TOOL=docker"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"-t {env['TRACE_IMAGE'].split('@')[0]} ." in planned.stdout
