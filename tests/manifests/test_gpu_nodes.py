"""GPU pods land only on nodes whose NVIDIA driver runs the GPU image's CUDA: the RayCluster's
GPU groups, the Argo workflow's GPU steps and the KFP pipeline's (by default) all require the
driver that ``components.images.GPU_DRIVER_MAJOR`` names, and that number is the one the CUDA
release of the GPU image's torch needs (read from the pinned wheel's own requirements)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from packaging.utils import canonicalize_name
from packaging.version import Version
from support import image_requirements, render

from components.images import DRIVER_LABELS, GPU_DRIVER_MAJOR, gpu_node_affinity
from pipelines.trace_training import COMPILED, PipelineOptions

REPO = render.REPO
MIN_DRIVER = {12: 525, 13: 580}
"""The oldest Linux driver branch of each CUDA major release (NVIDIA's CUDA toolkit release
notes, "CUDA Toolkit and Minimum Required Driver Version")."""


def test_the_rule_reads_both_of_gfds_driver_labels() -> None:
    required: Any = gpu_node_affinity()["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required["nodeSelectorTerms"]
    by_label = {}
    for term in terms:
        present, driver = term["matchExpressions"]
        assert present == {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
        assert driver["operator"] == "Gt"
        by_label[driver["key"]] = int(driver["values"][0]) + 1  # Gt 579: 580 and newer
    assert by_label == dict.fromkeys(DRIVER_LABELS, GPU_DRIVER_MAJOR)


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
def test_the_rayclusters_gpu_groups_require_the_driver(
    built: dict[str, list[render.Manifest]], overlay: str
) -> None:
    cluster = next(o for o in built[overlay] if o["kind"] == "RayCluster")
    groups = cluster["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["gpu"]  # one pod per GPU node
    for group in groups:
        spec = group["template"]["spec"]
        assert spec["affinity"] == {"nodeAffinity": gpu_node_affinity()}, group["groupName"]
        assert "nodeSelector" not in spec  # the rule lives in the affinity alone
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]


def test_the_argo_workflows_gpu_steps_require_the_driver() -> None:
    workflow = yaml.safe_load((REPO / "manifests/argo/workflowtemplate.yaml").read_text())
    gpu_steps = []
    for template in workflow["spec"]["templates"]:
        limits = (template.get("container") or {}).get("resources", {}).get("limits", {})
        if "nvidia.com/gpu" in limits:
            gpu_steps.append(template["name"])
            assert template["affinity"] == {"nodeAffinity": gpu_node_affinity()}
        else:
            assert "affinity" not in template, template["name"]
    assert gpu_steps == ["open-session", "iterate"]


def test_the_kfp_pipelines_gpu_steps_require_the_driver_by_default() -> None:
    """Without a Ray cluster by default; with one (the default ray_jobs_url) the GPUs are the
    cluster's workers', whose groups carry the rule (above), and the steps' default is none."""
    pipeline, platform = yaml.safe_load_all(COMPILED.read_text())
    parameter = pipeline["root"]["inputDefinitions"]["parameters"]["gpu_node_affinity"]
    expected = {} if PipelineOptions().ray_jobs_url else gpu_node_affinity()
    assert parameter.get("defaultValue", {}) == expected
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, config in executors.items():
        gpu = name.startswith(("exec-open-session", "exec-iterate"))
        assert ("nodeAffinity" in config) == gpu, name


@pytest.mark.slow  # PyPI's metadata of the pinned torch (cached under build/ after one run)
def test_the_driver_is_the_one_the_gpu_images_cuda_needs() -> None:
    image = image_requirements.IMAGES["gpu"]
    pins = image_requirements.parse_pins(image_requirements.image_constraints("gpu"))
    torch = pins[canonicalize_name("torch")]
    metadata = image_requirements.wheels("torch", image.tags())[torch]
    cuda = [
        r
        for r in image_requirements.requires(metadata)
        if canonicalize_name(r.name) == "cuda-toolkit"
        and image_requirements.applies(r, image.environment, ())
    ]
    assert cuda, f"torch {torch} for the GPU image requires no cuda-toolkit"
    (version,) = {Version(s.version).major for r in cuda for s in r.specifier}
    assert MIN_DRIVER[version] == GPU_DRIVER_MAJOR


def test_the_deploy_guide_says_which_driver_beside_the_cuda_version() -> None:
    guide = (REPO / "docs/deploy.md").read_text()
    line = next(line for line in guide.splitlines() if "CUDA 13" in line)
    assert f"R{GPU_DRIVER_MAJOR}" in line, line
