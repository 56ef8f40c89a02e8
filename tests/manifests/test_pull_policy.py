"""One image pull policy everywhere: IfNotPresent. The images are pinned by release tag
(components/images.env) and a tag is pushed once, so a node that holds the tag holds the right
image; ``Always`` would pull the GPU image (≈10 GB) again at every Ray worker start.

- every container of every rendered overlay names IfNotPresent, the Argo steps included;
- the pods KubeRay adds containers to inherit it: its ``wait-gcs-ready`` init container takes
  the Ray container's policy and the autoscaler sidecar IfNotPresent unless
  ``autoscalerOptions.imagePullPolicy`` says otherwise (ray-operator/controllers/ray/common/pod.go,
  v1.6.0: ``BuildPod``, ``BuildAutoscalerContainer``);
- the compiled KFP pipeline sets no policy (KFP 2.16's driver sets one only when the executor's
  Kubernetes config names it: backend/src/v2/driver/k8s.go), so Kubernetes' default applies,
  which is IfNotPresent for an image with a tag other than ``latest``: every image it names has one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from support import render

from pipelines.argo import DEFAULT_DIR as ARGO_DIR
from pipelines.trace_training import COMPILED

POLICY = "IfNotPresent"


def pull_policies(objects: list[render.Manifest]) -> Iterator[tuple[str, str | None]]:
    """(where, imagePullPolicy) of every container the objects' pods run."""
    for obj in objects:
        if obj["kind"] == "RayCluster":
            options = obj["spec"].get("autoscalerOptions") or {}
            where = f"{render.name_of(obj)}, autoscaler sidecar"
            yield where, options.get("imagePullPolicy", POLICY)  # KubeRay's default
        for template in render.pod_templates(obj):
            for key in ("initContainers", "containers"):
                for container in template.spec.get(key, []):
                    where = f"{template.source}, container {container['name']}"
                    yield where, container.get("imagePullPolicy")


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_every_rendered_container_pulls_if_not_present(built: render.Builds, overlay: str) -> None:
    found = list(pull_policies(built[overlay]))
    assert len(found) >= 3
    assert [(where, policy) for where, policy in found if policy != POLICY] == []
    assert "Always" not in re.findall(r"imagePullPolicy: (\w+)", yaml.safe_dump_all(built[overlay]))


def test_the_argo_manifests_pull_if_not_present() -> None:
    for path in sorted(ARGO_DIR.glob("*.yaml")):
        text = path.read_text()
        assert set(re.findall(r"imagePullPolicy: (\w+)", text)) <= {POLICY}, path
        objects = [doc for doc in yaml.safe_load_all(text) if doc and doc.get("kind")]
        assert [w for w, policy in pull_policies(objects) if policy != POLICY] == [], path


def test_a_container_that_pulls_always_is_named() -> None:
    pod: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x:1", "imagePullPolicy": "Always"}]},
    }
    assert list(pull_policies([pod])) == [("Pod p, container c", "Always")]


def test_the_compiled_pipeline_leaves_kubernetes_default_if_not_present() -> None:
    text = COMPILED.read_text()
    assert "Always" not in re.findall(r"imagePullPolicy: (\w+)", text)
    pipeline, platform = yaml.safe_load_all(text)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert executors and all(c.get("imagePullPolicy", POLICY) == POLICY for c in executors.values())
    images = {e["container"]["image"] for e in pipeline["deploymentSpec"]["executors"].values()}
    assert len(images) == 2  # the CPU image and the GPU image
    for image in images:
        name = image.split("@")[0].rsplit("/", 1)[-1]
        assert ":" in name and not name.endswith(":latest"), image  # tagged: IfNotPresent
