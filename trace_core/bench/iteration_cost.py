"""``trace-rl bench iteration-cost``: what one training iteration costs outside rollout and
update, for Qwen3 1.7B, 8B and 14B on their recommended cluster shapes.

Per iteration the pipeline runs rollout → (fit-predictor ∥ update-policy) → next rollout
(DESIGN.md). Besides the rollout (simulated: ``scale_sim`` on the model's GPU profile, the
stored trees copied to M roots and their turns scaled to ``turn_tokens`` generated tokens)
and the update (FLOPs at an assumed utilisation), it pays:

* **S3 bytes.** The update reads and writes the policy (bf16, 2 bytes per parameter) and its
  optimizer state (AdamW's two fp32 moments, 8 bytes per parameter, ``optimizer.safetensors``,
  which only the update touches); every rollout node downloads the new policy once
  (``rollout.weights``); the trees go up and come back to the update and the predictor.
* **Reload.** Every engine loads the new weights in place (vLLM ``reload``, no restart); the
  engines reload in parallel, so the iteration waits for one.
* **Pods.** Each KFP step is a pod; two start on the critical path (rollout, then the
  update). Image pulls happen on a node's first iteration only and are reported apart.

Every rate below is an assumption or a public figure, named where it is defined and cited in
docs/scaling.md; none is measured here. What is computed: bytes from parameter counts, and
rollout seconds from the simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from trace_core.bench.scale import GPU_PROFILES, QWEN3, ScaleBenchConfig, load_stream
from trace_core.bench.scale_sim import VARIANTS, simulate
from trace_core.bench.scale_trace import resize_stream

S3_POD_BYTES_S = 1.0e9
"""Assumption: one pod's S3 stream (GET or PUT) on a 10-25 GbE node, MinIO/SeaweedFS."""
S3_CLUSTER_BYTES_S = 10.0e9
"""Assumption: the S3 service's aggregate throughput, shared by the pods reading at once."""
RELOAD_BYTES_S = 2.0e9
"""Assumption: vLLM loading safetensors from the node's disk into GPU memory."""
RELOAD_FIXED_S = 5.0
"""Assumption: vLLM's fixed cost of an in-place reload (cache reset, sync)."""
STEP_POD_S = 15.0
"""Assumption: a KFP step's pod scheduled, its launcher run and its container started, image
cached (KFP v2 runs a driver and a launcher per step)."""
IMAGE_BYTES = 10e9
"""Assumption: a CUDA + torch + vLLM image, compressed."""
PULL_BYTES_S = 250e6
"""Assumption: registry pull into a node."""
UPDATE_MFU = 0.35
"""Assumption: model FLOPs utilisation of the update (FSDP, bf16, H100)."""
GPU_FLOPS = 989e12
"""H100 SXM dense bf16 (NVIDIA datasheet)."""


@dataclass(frozen=True)
class ClusterShape:
    """A recommended cluster for one model size (docs/scaling.md says why)."""

    workers: int
    """Engine workers (data parallel; one vLLM each)."""
    gpus_per_worker: int
    """Tensor parallel GPUs per engine."""
    roots: int
    """M (the stored trees are copied to about this many roots; their N is kept)."""
    update_gpus: int
    turn_tokens: int = 256
    """Mean generated tokens per turn the trees are scaled to."""


SHAPES = {
    "1.7b": ClusterShape(workers=8, gpus_per_worker=1, roots=512, update_gpus=8),
    "8b": ClusterShape(workers=16, gpus_per_worker=1, roots=1024, update_gpus=16),
    "14b": ClusterShape(workers=16, gpus_per_worker=1, roots=1024, update_gpus=32),
}
"""By Qwen3 size (``scale.QWEN3``); the GPU profile of each is ``h100-SIZE-vllm``."""


@dataclass(frozen=True)
class IterationCost:
    model: str
    """A Qwen3 size: 1.7b, 8b, 14b."""
    policy_bytes: float
    optimizer_bytes: float
    s3_bytes: float
    """Policy: written once, read by the update and by every rollout node; optimizer state:
    read and written by the update; trees: written, read twice."""
    s3_s: float
    update_io_s: float
    """The part of ``s3_s`` the update spends reading and writing policy and optimizer."""
    reload_s: float
    pods_s: float
    image_pull_s: float
    """A node's first iteration only (not in ``total_s``)."""
    rollout_s: float
    rollout_utilisation: float
    update_s: float
    generated_tokens: int
    train_tokens: int
    roots: int
    continuations: float
    """N of the trees: continuations per root."""

    @property
    def total_s(self) -> float:
        return self.s3_s + self.reload_s + self.pods_s + self.rollout_s + self.update_s

    @property
    def outside_share(self) -> float:
        """Share of the iteration spent outside rollout and update."""
        return (self.s3_s + self.reload_s + self.pods_s) / self.total_s

    def to_json(self) -> dict[str, object]:
        shape = SHAPES[self.model]
        return {
            **asdict(self),
            "shape": asdict(shape),
            "total_s": self.total_s,
            "outside_share": self.outside_share,
        }


def run_iteration_cost(
    trees: Sequence[Path], models: Sequence[str] = tuple(SHAPES)
) -> list[IterationCost]:
    """Every model of ``models`` on its shape, its rollout's shape taken from ``trees``."""
    base = load_stream(ScaleBenchConfig(tuple(trees), GPU_PROFILES["h100-8b-vllm"]))
    trace = next(v for v in VARIANTS if v.name == "trace")
    roots_per_copy = max(int(np.count_nonzero(base.parent < 0)), 1)
    out = []
    for model in models:
        shape, params = SHAPES[model], QWEN3[model].params
        scale = shape.turn_tokens / max(float(base.generated_tokens.mean()), 1.0)
        stream = resize_stream(base, max(1, round(shape.roots / roots_per_copy)), scale)
        sim = simulate(stream, trace, shape.workers, GPU_PROFILES[f"h100-{model}-vllm"].cost)
        leaves = np.ones(stream.turns, dtype=bool)
        leaves[stream.parent[stream.parent >= 0]] = False
        train_tokens = int((stream.prompt_tokens[leaves] + stream.generated_tokens[leaves]).sum())
        policy, optimizer = 2 * params, 8 * params
        trees_bytes = 8.0 * (stream.generated_tokens.sum() + stream.observation_tokens.sum())
        nodes = math.ceil(shape.workers * shape.gpus_per_worker / 8)  # 8 GPUs a node
        s3_bytes = policy * (1 + 1 + nodes) + 2 * optimizer + 3 * trees_bytes
        rollout_read = max(policy / S3_POD_BYTES_S, nodes * policy / S3_CLUSTER_BYTES_S)
        update_io = 2 * (policy + optimizer) / S3_POD_BYTES_S
        out.append(
            IterationCost(
                model=model,
                policy_bytes=policy,
                optimizer_bytes=optimizer,
                s3_bytes=float(s3_bytes),
                s3_s=rollout_read + update_io + 3 * trees_bytes / S3_POD_BYTES_S,
                update_io_s=update_io,
                reload_s=RELOAD_FIXED_S + policy / (RELOAD_BYTES_S * shape.gpus_per_worker),
                pods_s=2 * STEP_POD_S,
                image_pull_s=IMAGE_BYTES / PULL_BYTES_S,
                rollout_s=sim.makespan_s,
                rollout_utilisation=sim.utilisation,
                update_s=8 * params * train_tokens / (shape.update_gpus * GPU_FLOPS * UPDATE_MFU),
                generated_tokens=sim.generated_tokens,
                train_tokens=train_tokens,
                roots=int(np.count_nonzero(stream.parent < 0)),
                continuations=float(
                    stream.branch.sum() / max(np.count_nonzero(stream.parent < 0), 1)
                ),
            )
        )
    return out
