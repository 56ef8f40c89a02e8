"""/dev/shm on the RayCluster's GPU pods, as the overlays render them: Ray's object store is
sized on purpose, and what it leaves of /dev/shm holds NCCL and vLLM.

Without ``object-store-memory`` Ray 2.60 takes 30% of the pod's memory for its object store,
capped at 95% of /dev/shm (``ray/_private/utils.py::resolve_object_store_memory``), so on these
pods nearly all of /dev/shm. The rule checked here is the arithmetic beside the numbers in
``manifests/base/raycluster.yaml``: per GPU at most ≈ 2 GiB for NCCL's shared-memory transport
in each communicator its process is in (32 channels × 7 peers × ≈ 9 MiB of buffers per rank,
when GPUs have no P2P path), two of them (a trainer: FSDP's group and the weight broadcast; an
engine: the broadcast and its tensor-parallel group), plus 2 GiB for vLLM's message queues (10
chunks of 24 MiB each, 8 engines at most on a pod).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from support import render

GIB = 2**30
NCCL_PER_GPU = 2 * GIB
COMMUNICATORS = 2
"""NCCL groups a GPU's process is in at once: the trainers' and the weight broadcast's, or the
broadcast's and an engine's tensor-parallel group."""
VLLM_QUEUES = 2 * GIB
MIN_OBJECT_STORE = 2 * GIB
"""The engines' results and the update's figures pass through the object store: a few hundred
MB at the most an iteration moves; 2 GiB is the floor kept."""

UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity (``16Gi``, ``512Mi``, ``1000``)."""
    for suffix, scale in UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def gpu_groups(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The worker groups whose pods hold GPUs."""
    groups = []
    for group in cluster["spec"].get("workerGroupSpecs", []):
        (container,) = group["template"]["spec"]["containers"]
        if int(container["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0:
            groups.append(group)
    return groups


def shared_memory_problems(cluster: dict[str, Any]) -> list[str]:
    """One line per GPU worker group whose /dev/shm is not split as the rule says."""
    problems = []
    for group in gpu_groups(cluster):
        name = group["groupName"]
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        store_text = (group.get("rayStartParams") or {}).get("object-store-memory")
        if store_text is None:
            problems.append(f"{name}: no object-store-memory: Ray would take nearly all /dev/shm")
            continue
        store = int(store_text)  # bytes, as `ray start --object-store-memory` takes them
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        shm = volumes.get(mounts.get("/dev/shm", ""), {}).get("emptyDir")
        if not shm or shm.get("medium") != "Memory" or "sizeLimit" not in shm:
            problems.append(f"{name}: /dev/shm is not a sized in-memory emptyDir")
            continue
        size = quantity(shm["sizeLimit"])
        room = size - store
        needed = gpus * COMMUNICATORS * NCCL_PER_GPU + VLLM_QUEUES
        if store < MIN_OBJECT_STORE:
            problems.append(f"{name}: object store {store / GIB:.1f} GiB < 2 GiB")
        if room < needed:
            problems.append(
                f"{name}: /dev/shm {size / GIB:.0f} GiB less the object store "
                f"{store / GIB:.0f} GiB leaves {room / GIB:.1f} GiB, under the "
                f"{needed / GIB:.0f} GiB NCCL and vLLM need on {gpus} GPU(s)"
            )
        limit = quantity(container["resources"]["limits"]["memory"])
        if size > limit:
            problems.append(f"{name}: /dev/shm {size / GIB:.0f} GiB exceeds the memory limit")
    return problems


def cluster_of(built: dict[str, list[render.Manifest]], overlay: str) -> dict[str, Any]:
    return next(o for o in built[overlay] if o["kind"] == "RayCluster")


@pytest.mark.parametrize("overlay", ["kfp", "standalone"])
def test_the_object_store_leaves_room_in_dev_shm_for_nccl_and_vllm(
    built: dict[str, list[render.Manifest]], overlay: str
) -> None:
    cluster = cluster_of(built, overlay)
    assert [g["groupName"] for g in gpu_groups(cluster)] == ["gpu"]
    assert shared_memory_problems(cluster) == []


def test_a_gpu_group_left_to_rays_default_is_named(
    built: dict[str, list[render.Manifest]],
) -> None:
    cluster = copy.deepcopy(cluster_of(built, "kfp"))
    (group,) = gpu_groups(cluster)
    del group["rayStartParams"]["object-store-memory"]
    assert shared_memory_problems(cluster) == [
        "gpu: no object-store-memory: Ray would take nearly all /dev/shm"
    ]
    # 8 GPUs × 2 communicators × 2 GiB + 2 GiB of vLLM's queues = 34 GiB; 64 − 40 leaves 24.
    group["rayStartParams"]["object-store-memory"] = str(40 * GIB)
    assert shared_memory_problems(cluster) == [
        "gpu: /dev/shm 64 GiB less the object store 40 GiB leaves 24.0 GiB, under the 34 GiB "
        "NCCL and vLLM need on 8 GPU(s)"
    ]


def test_the_dev_cluster_has_no_gpu_group(built: dict[str, list[render.Manifest]]) -> None:
    """dev's CPU workers run neither NCCL nor vLLM's GPU path: the rule is for GPU pods."""
    assert gpu_groups(cluster_of(built, "dev")) == []


def test_quantities_are_read_as_kubernetes_writes_them() -> None:
    assert quantity("16Gi") == 16 * GIB and quantity("512Mi") == GIB // 2
    assert quantity("1G") == 10**9 and quantity("4294967296") == 4 * GIB
