"""`make manifests REGISTRY=...`: a team's own registry in components/images.env, names and
tags kept, comments kept, a malformed registry refused before anything is written."""

from __future__ import annotations

import pytest

from pipelines.regenerate import move_to_registry

IMAGES = """\
# the project's images
TRACE_IMAGE=ghcr.io/trace-rl/trace:0.1.0
TRACE_GPU_IMAGE=ghcr.io/trace-rl/trace-gpu:0.1.0@sha256:{digest}
""".format(digest="a" * 64)


def test_both_images_move_to_the_registry() -> None:
    moved = move_to_registry(IMAGES, "registry.example.com:5000/ml/")
    assert moved.splitlines() == [
        "# the project's images",
        "TRACE_IMAGE=registry.example.com:5000/ml/trace:0.1.0",
        "TRACE_GPU_IMAGE=registry.example.com:5000/ml/trace-gpu:0.1.0",
    ]


@pytest.mark.parametrize("registry", ["https://registry.example.com", "Registry/ML", "r.io/x:1"])
def test_a_malformed_registry_is_refused(registry: str) -> None:
    with pytest.raises(ValueError, match=f"REGISTRY '{registry}'"):
        move_to_registry(IMAGES, registry)
