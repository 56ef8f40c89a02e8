"""The wheels of the GPU image's releases, for ``policy.upstream``'s static check: every name the
GPU path calls, resolved against the source of the releases the image pins, without installing
them (and without a GPU).

    python tests/support/upstream_source.py             # exit 1 and one line per failure
    python tests/support/upstream_source.py 'vllm.SamplingParams(n, temprature)'   # just these

The versions are the image's: its constraints as its Dockerfile merges them (the lock,
``requirements/constraints.txt``, with ``images/trace-gpu/overrides.txt`` over it:
``image_requirements.gpu_constraints``), for each package an entry names (vllm, torch,
transformers from the overrides; ray and safetensors from the lock). Each wheel is fetched once
with ``pip download --no-deps`` for the image's Python and cached under
``build/upstream-wheels/`` (written whole, then renamed; a lock file keeps parallel pytest-xdist
workers from fetching it twice); nothing in them is imported or run.

torch is read from its macOS arm64 wheel (127 MB) instead of the image's Linux CUDA wheel (far
larger): a release's Python sources and ``.pyi`` stubs are the same in every platform's wheel,
and they are all the check reads (``torch/_C/_distributed_c10d.pyi`` declares
``ProcessGroupNCCL`` in every build's wheel, whether the build has NCCL or not).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "upstream-wheels"

if __name__ == "__main__":  # run as a script: this folder as the package tests/conftest.py makes
    sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support import image_requirements  # noqa: E402
from support.locks import locked  # noqa: E402
from trace_core.policy import upstream  # noqa: E402

LINUX = ("manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux2014_x86_64")
"""The GPU image's platform tags pip is asked for (a pure-Python wheel comes either way)."""
PLATFORMS = {"torch": ("macosx_14_0_arm64",)}
"""Packages read from another platform's wheel (see the module docstring)."""


@dataclass(frozen=True)
class Fetched:
    """What ``image_wheels`` took: each wheel, and for those downloaded now, the seconds."""

    wheels: tuple[Path, ...]
    downloaded: dict[str, float]

    @property
    def size(self) -> int:
        return sum(w.stat().st_size for w in self.wheels)


def image_pins() -> dict[str, str]:
    """Canonical package name → the version the GPU image installs."""
    pins = image_requirements.parse_pins(image_requirements.gpu_constraints())
    return {name: str(version) for name, version in pins.items()}


def packages(names: Sequence[str] | None = None) -> list[str]:
    """The packages the ``UPSTREAM`` lists and ``names`` name (their top-level modules, which
    are the packages' names): all of them, so that a class's bases in another package are
    read too (transformers' models derive from torch's ``nn.Module``)."""
    listed = upstream.entries(platform="cuda") + upstream.entries(names or [], "cuda")
    return sorted({canonicalize_name(e.name.split(".")[0]) for e in listed})


def image_wheels(names: Sequence[str] | None = None) -> Fetched:
    """The GPU image's wheel of every package the entries name, from the cache or fetched."""
    pins = image_pins()
    unpinned = [p for p in packages(names) if p not in pins]
    if unpinned:
        raise RuntimeError(f"the GPU image pins no version of {', '.join(unpinned)}")
    wheels, downloaded = [], {}
    for package in packages(names):
        wheel, seconds = wheel_for(package, pins[package])
        wheels.append(wheel)
        if seconds is not None:
            downloaded[wheel.name] = seconds
    return Fetched(tuple(wheels), downloaded)


def wheel_for(package: str, version: str) -> tuple[Path, float | None]:
    """The cached wheel of ``package==version`` (fetched first if absent) and the seconds the
    fetch took (None: it was cached)."""
    found = _cached(package, version)
    if found is not None:
        return found, None
    CACHE.mkdir(parents=True, exist_ok=True)
    with locked(CACHE / ".lock"):
        found = _cached(package, version)  # another worker fetched it meanwhile
        if found is not None:
            return found, None
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".download-") as work:
            platforms = PLATFORMS.get(package, LINUX)
            python = ".".join(map(str, image_requirements.IMAGES["gpu"].python))
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
            command += ["--only-binary=:all:", "--python-version", python]
            command += [f"--platform={p}" for p in platforms]
            command += ["--dest", work, f"{package}=={version}"]
            # This machine's pip configuration may cap packages with a constraints file (the
            # cap need not hold for the image's versions): an empty one replaces it. (An empty
            # PIP_CONSTRAINT does not: pip then keeps the configured file.)
            env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
            if run.returncode != 0:
                raise RuntimeError(
                    f"pip download {package}=={version} failed:\n{run.stderr[-2000:]}"
                )
            (got,) = Path(work).glob("*.whl")
            target = CACHE / got.name
            os.replace(got, target)  # whole or not at all: the cache never holds a partial file
        return target, time.perf_counter() - start


def _cached(package: str, version: str) -> Path | None:
    platforms = PLATFORMS.get(package, ())
    for wheel in sorted(CACHE.glob("*.whl")):
        name, got, _, tags = parse_wheel_filename(wheel.name)
        if name != package or str(got) != version:
            continue
        if platforms and not any(t.platform in platforms for t in tags):
            continue
        return wheel
    return None


def check(names: Sequence[str] | None = None) -> tuple[list[str], Fetched, upstream.WheelSource]:
    """The entries (default: every ``UPSTREAM`` entry for the image) that do not hold in the
    GPU image's wheels, one line each; the wheels; the source read."""
    fetched = image_wheels(names)
    source = upstream.WheelSource(fetched.wheels)
    return upstream.unresolved(source, names), fetched, source


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    names = argv or None
    failures, fetched, source = check(names)
    checked = upstream.entries(names, "cuda")
    for failure in failures:
        print(f"FAIL {failure}")
    releases = ", ".join(sorted(set(source.releases.values())))
    fetches = ", ".join(f"{n} in {s:.1f} s" for n, s in fetched.downloaded.items()) or "none"
    with_parameters = sum(e.parameters for e in checked)
    print(
        f"{len(checked) - len(failures)} of {len(checked)} entries hold in {releases} "
        f"({with_parameters} with parameters); wheels {fetched.size / 1e6:.0f} MB "
        f"(fetched now: {fetches}); {time.perf_counter() - start:.1f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
