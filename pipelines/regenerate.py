"""Everything that names the project's images, rewritten from ``components/images.env``:

    make manifests                                   # = python -m pipelines.regenerate
    make manifests REGISTRY=registry.example.com/ml  # first: both images in that registry

1. ``manifests/images/kustomization.yaml``: the kustomize component every overlay applies;
2. ``pipelines/compiled/trace_training.yaml``: the KFP pipeline, with the default options;
3. ``manifests/argo/``: the Argo WorkflowTemplate and CronWorkflow, with the default options.

Set an image by editing its line in ``components/images.env`` (the one place), then run this;
``--registry`` (``REGISTRY=`` to make) rewrites both lines first, keeping each image's name and
tag (``REGISTRY/trace``, ``REGISTRY/trace-gpu``), for a team that pushes to its own registry. The
tests fail while any of the three differs from what this writes (``tests/images``,
``tests/pipelines``). A compile with other options (``trace-rl pipeline compile --image ...``)
is a separate file of your own.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from components.images import IMAGES_ENV, read_images
from pipelines.argo import DEFAULT_DIR as ARGO_DIR
from pipelines.argo import write_manifests
from pipelines.trace_training import COMPILED, compile_pipeline

IMAGES_COMPONENT = IMAGES_ENV.parents[1] / "manifests" / "images" / "kustomization.yaml"
# The name each image has in the manifests (what the component's entries match).
MANIFEST_NAMES = {"TRACE_IMAGE": "trace", "TRACE_GPU_IMAGE": "trace-gpu"}
HEADER = """\
# The project's image references, applied by every overlay (`components: [../../images]`) after
# its own patches. Written by `make manifests` from components/images.env, the one place they are
# set: edit that file, not this one (tests/images/test_image_refs.py checks the two agree).
"""


def split_reference(reference: str) -> dict[str, str]:
    """``registry/path/name:tag@sha256:...`` as kustomize's newName, newTag and digest."""
    rest, _, digest = reference.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    name, tag = (rest[:colon], rest[colon + 1 :]) if colon > slash else (rest, "")
    fields = {"newName": name}
    if tag:
        fields["newTag"] = tag
    if digest:
        fields["digest"] = digest
    return fields


def images_component(images: dict[str, str]) -> str:
    """The text of ``manifests/images/kustomization.yaml`` for these references."""
    entries = [
        {"name": manifest_name, **split_reference(images[variable])}
        for variable, manifest_name in MANIFEST_NAMES.items()
    ]
    body = {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "images": entries,
    }
    return HEADER + yaml.safe_dump(body, sort_keys=False, indent=2)


_REGISTRY = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:\d+)?(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?)*")


def move_to_registry(text: str, registry: str) -> str:
    """``components/images.env``'s text with every reference in ``registry``: the image's last
    path part (its name) and its tag stay, a digest is dropped (it named the old registry's
    manifest; the pushed image gets its own). Comments and order are kept."""
    registry = registry.rstrip("/")
    if not _REGISTRY.fullmatch(registry):
        raise ValueError(
            f"REGISTRY {registry!r}: expected a registry and path, such as "
            "registry.example.com/ml or localhost:5000/team (no scheme, no tag)"
        )
    lines = []
    for line in text.splitlines():
        name, sep, reference = line.partition("=")
        if sep and name in MANIFEST_NAMES:
            fields = split_reference(reference.strip())
            image = fields["newName"].rsplit("/", 1)[-1]
            tag = f":{fields['newTag']}" if "newTag" in fields else ""
            line = f"{name}={registry}/{image}{tag}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def regenerate(registry: str = "") -> list[Path]:
    """Write the three from ``components/images.env`` (moved to ``registry`` first, if given);
    the paths written."""
    if registry:
        IMAGES_ENV.write_text(move_to_registry(IMAGES_ENV.read_text(), registry))
    read_images.cache_clear()
    images = read_images()
    missing = sorted(set(MANIFEST_NAMES) - set(images))
    if missing:
        raise KeyError(f"{IMAGES_ENV}: no {', '.join(missing)} line")
    IMAGES_COMPONENT.write_text(images_component(images))
    written = [IMAGES_COMPONENT, compile_pipeline(COMPILED), *write_manifests(ARGO_DIR)]
    return [IMAGES_ENV, *written] if registry else written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default="", help="move both images to this registry first")
    try:
        written = regenerate(parser.parse_args().registry)
    except ValueError as err:
        sys.exit(f"make manifests: {err}")
    for path in written:
        print(f"wrote {path.relative_to(IMAGES_ENV.parents[1])}", file=sys.stdout)
