"""The container images the components (and the Argo workflows) run in.

    image("TRACE_IMAGE")        # ghcr.io/trace-rl/trace:0.1.0, the CPU steps' base image
    image("TRACE_GPU_IMAGE")    # the rollout and update steps' base image

``components/images.env`` is the one place image references are set (``NAME=reference`` lines,
``#`` comments); the components, the Argo workflows, the manifests and ``make images`` all
read it. Nothing here has a default: a missing file or name is an error naming it.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

IMAGES_ENV = Path(__file__).resolve().with_name("images.env")
_LINE = re.compile(r"([A-Z][A-Z0-9_]*)=(\S+)")


@cache
def read_images(path: Path = IMAGES_ENV) -> dict[str, str]:
    """Every ``NAME=reference`` line of ``path``."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; it sets the project's image references")
    images = {}
    for n, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if not match:
            raise ValueError(f"{path}, line {n}: expected NAME=image-reference, got {line!r}")
        images[match[1]] = match[2]
    return images


def image(name: str) -> str:
    """The image reference ``name`` is set to in ``components/images.env``."""
    images = read_images()
    if name not in images:
        raise KeyError(f"{IMAGES_ENV}: no {name}=... line (it has {', '.join(sorted(images))})")
    return images[name]


# An image reference (registry/path:tag and/or @sha256:digest) and a Secret's name (DNS-1123).
_REFERENCE = re.compile(
    r"[a-z0-9][a-z0-9._:/-]*[a-z0-9](:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?"
)
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def check_images(image: str, gpu_image: str, pull_secrets: tuple[str, ...]) -> None:
    """Raise ValueError naming the field when a reference or a pull secret's name is malformed."""
    for field, reference in (("image", image), ("gpu_image", gpu_image)):
        if not _REFERENCE.fullmatch(reference):
            raise ValueError(f"{field} {reference!r}: expected an image reference")
    for secret in pull_secrets:
        if not _SECRET_NAME.fullmatch(secret):
            raise ValueError(f"image pull secret {secret!r}: not a Kubernetes Secret name")


GPU_DRIVER_MAJOR = 580
"""The oldest NVIDIA driver branch TRACE_GPU_IMAGE runs on. The image is a CUDA 13.0 stack
(torch 2.14.0 requires ``cuda-toolkit==13.0.3``; vLLM 0.33.0's ``cu13`` kernels), and CUDA 13.0
needs the R580 driver or newer; on an older driver its first CUDA call fails."""

DRIVER_LABELS = ("nvidia.com/cuda.driver-version.major", "nvidia.com/cuda.driver.major")
"""The labels NVIDIA's GPU feature discovery (the GPU operator's GFD) puts on a GPU node with
its driver's major version: the current one, and the older name that releases before it set."""


def gpu_node_affinity() -> dict[str, object]:
    """The Kubernetes ``nodeAffinity`` of every pod that runs TRACE_GPU_IMAGE on GPUs: a node
    with GPUs (``nvidia.com/gpu.present``) whose driver is ``GPU_DRIVER_MAJOR`` or newer, read
    from either of GFD's labels (the terms are alternatives). The RayCluster's GPU groups carry
    the same rule (``manifests/base/gpu-nodes.yaml``; tests/manifests check they agree)."""
    present = {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
    terms = [
        {
            "matchExpressions": [
                present,
                {"key": label, "operator": "Gt", "values": [str(GPU_DRIVER_MAJOR - 1)]},
            ]
        }
        for label in DRIVER_LABELS
    ]
    return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
