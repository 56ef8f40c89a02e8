"""``trace-rl bench iteration-cost``: what one training iteration costs outside rollout and
update, for Qwen3 1.7B, 8B and 14B on their recommended cluster shapes, in two designs.

Per iteration: rollout → (fit the predictor ∥ update the policy) → next rollout. The rollout is
simulated (``scale_sim`` on the model's GPU profile, the stored trees copied to M roots and
their turns scaled to ``turn_tokens`` generated tokens); the update is FLOPs at an assumed
utilisation. Around them:

* **``s3``: the state handed through S3 every iteration** (the pipeline's steps as they ran
  before the run's session: a rollout step and an update step, each its own pod and process).
  Every copy is counted, in order: the update step's KFP launcher downloads the policy, the
  reference and the optimizer state; the Ray job's driver downloads the optimizer state and
  the trees again; every update rank downloads the policy and the optimizer state; rank 0
  uploads the result to staging; the driver downloads and re-uploads it; the KFP pod downloads
  it and its launcher uploads it as the step's outputs; then the rollout pod and every engine
  node download the policy, and every engine reloads it from disk. The optimizer state is
  AdamW's two fp32 moments and the fp32 master weights (12 B a parameter: the policy is served
  in bf16).
* **``resident``: trainers and engines live across iterations** (``train.trainer_group``; the
  pipeline's session, ``train.steps.session``, and ``trace-rl train --train-workers``): one
  step pod per iteration; S3 carries the trees, predictor and metrics every iteration, and a
  checkpoint (policy, optimizer state, master weights) every ``checkpoint_every`` iterations,
  written by trainer rank 0 in the background while the next rollout runs (what outlasts the
  rollout holds up the next update; the cost per iteration is its share); new weights reach
  the engines by an NCCL broadcast from trainer rank 0 at ``NCCL_BYTES_S``, loaded in place.

**Transports.** Each row lists its transfers (``Transfer``) with the transport each takes,
derived from where the run's devices land (``RunLayout``, as ``rollout.placement`` reserves
them: the trainers' GPUs as one bundle on one node, the engines filling the rest of that node,
then further nodes of ``GPUS_PER_NODE``): the weight broadcast from trainer rank 0 runs NCCL
over NVLink and shared memory to engines beside the trainers and over the network to engines
on other nodes; FSDP's all-gathers stay within the trainers' node while the trainers fit in
one (a shape whose update GPUs exceed a node spans several, over the network; a pipeline run
refuses such trainers, ``TrainConfig``); S3 traffic goes over the network to the store. The
seconds are as above (the broadcast at the network's ``NCCL_BYTES_S`` in every shape here).

The s3 design pays two KFP step pods on the critical path (rollout, update), the resident one
one (the iteration step). Every rate below is an assumption, a public figure or (the reload)
the GPU check's measurement on one H200, named where it is defined and cited in
docs/scaling.md. What is computed: bytes from parameter counts, and rollout seconds from the
simulation.

**Bounded staleness** (``TrainConfig.max_staleness`` k, ``train.phases``), resident design only
(engines and trainers on GPUs of their own), in steady state (``staleness_costs``). With k = 0
an iteration is rollout → (fit ∥ update) → sync: rollout + max(fit, update) + sync. With k >= 1
the driver submits the update of i to the trainers, then fits the predictor (``FIT_S``) and
grows the trees of i + k on the engines, then syncs: max(fit + rollout, update) + sync. Both
add the step pod and the trees' S3 traffic, and a checkpoint's share: its upload holds up the
next update (``trainer_group``: ``update`` waits for it), after the next rollout at k = 0 but
at once at k >= 1; its cost is what it adds to the max(…) of the iteration after it, shared
over ``CHECKPOINT_EVERY`` iterations. k = 2 equals k = 1 here: the loop still syncs once an
iteration, between one rollout and one update, so a deeper k lets neither side bank time, and
the rollout is one simulation per model (no iteration-to-iteration variation to absorb); what
k = 2 changes is the staleness, and the k rollouts grown on the starting policy at the start.
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
RELOAD_BYTES_S = 1.41e9
"""Measured on one H200 (docs/gpu, the GPU check's reload stage): safetensors read from local
disk, out of the page cache, into GPU memory."""
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
NCCL_BYTES_S = 20e9
"""Assumption: an NCCL broadcast's bus bandwidth from trainer rank 0 to the engines across
nodes (one 400 Gb/s NIC a GPU: 50 GB/s raw; NCCL's broadcast reaches well under it)."""
SYNC_FIXED_S = 1.0
"""Assumption: pausing the engines, resetting their prefix caches, resuming."""
CHECKPOINT_EVERY = 5
"""``TrainConfig.checkpoint_every``'s default: the 8B checkpoint (115 GB from one rank at
``S3_POD_BYTES_S``, 17 s longer than the rollout it overlaps) is then ≈ 1% of a resident 8B
iteration."""
FIT_S = 20.0
"""Assumption: the predictor's fit on the driver, every shape: the fit of the docs/scaling
trees copied to 1,034 roots (15,463 new rows and 8,192 replayed, the default hashed features,
64-wide MLP, 10 epochs) took 19-23 s on this project's 2-core machine shared with other work
(up to 52 s under heavier load). Its cost follows the rows, not the turns' length (the hashed
features of prefixes 26x as long took 1.2x as long)."""
GPUS_PER_NODE = 8
"""GPUs of one node, which one worker pod holds whole (the RayCluster's GPU group;
``EngineConfig.gpus_per_node``)."""
NVLINK = "nccl-nvlink"
"""NCCL within one node: NVLink and shared memory (the node's GPUs are one pod's)."""
NETWORK = "nccl-network"
"""NCCL between nodes: each GPU's NIC (``NCCL_BYTES_S``)."""
S3 = "s3-network"
"""The object store, over the pods' network (``S3_POD_BYTES_S``, ``S3_CLUSTER_BYTES_S``)."""
DISK = "local-disk"
"""A node's disk (its page cache) into GPU memory (``RELOAD_BYTES_S``)."""
STALENESS = (0, 1, 2)
"""The ``max_staleness`` k the command prints."""
DESIGNS = ("s3", "resident")


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
class RunLayout:
    """Where a shape's GPUs land, as the run's placement group puts them (module docstring)."""

    trainer_nodes: int
    """Nodes the trainers span: 1 while they fit in one (their one bundle)."""
    engines_beside_trainers: int
    """Engine workers on the trainers' node (its GPUs the trainers leave)."""
    engine_nodes: int
    """Other nodes the rest of the engines fill."""

    @classmethod
    def of(cls, shape: ClusterShape) -> RunLayout:
        trainer_nodes = math.ceil(shape.update_gpus / GPUS_PER_NODE)
        left = trainer_nodes * GPUS_PER_NODE - shape.update_gpus  # beside the last trainer
        beside = min(shape.workers, left // shape.gpus_per_worker)
        rest = (shape.workers - beside) * shape.gpus_per_worker
        return cls(trainer_nodes, beside, math.ceil(rest / GPUS_PER_NODE))

    @property
    def sync_transport(self) -> str:
        """The weight broadcast from trainer rank 0: NVLink to the engines beside it, the
        network to those on other nodes (and to every engine when the trainers span nodes: rank
        0's node is then all trainers); joined by "+" when both."""
        if self.trainer_nodes > 1 or not self.engines_beside_trainers:
            return NETWORK
        return f"{NVLINK}+{NETWORK}" if self.engine_nodes else NVLINK

    @property
    def fsdp_transport(self) -> str:
        """The trainers' all-gathers and reduce-scatters: within their node, if one."""
        return NVLINK if self.trainer_nodes == 1 else NETWORK


@dataclass(frozen=True)
class Transfer:
    """One transfer of an iteration and the transport it takes."""

    name: str
    transport: str
    """``NVLINK``, ``NETWORK``, ``S3`` or ``DISK``; two joined by "+" when it takes both (the
    broadcast reaching engines beside the trainers and on other nodes)."""
    bytes: float
    """Per iteration (a checkpoint's: its share; ``s3_bytes`` is the sum of the S3 ones), or,
    for ``fsdp all-gather``, one gather of the policy."""
    where: str
    """From where to where, in words."""


def transfers(
    shape: ClusterShape, design: str, policy: float, handoff: float, engines: float, trees: float
) -> tuple[Transfer, ...]:
    """The transfers of one iteration of ``design`` on ``shape``, each with its transport:
    ``handoff``, the state's bytes through S3 (s3) or a checkpoint's share (resident);
    ``engines``, the policy's bytes to the engines' nodes (s3); ``trees``, the trees'."""
    layout = RunLayout.of(shape)
    trainers = f"{shape.update_gpus} trainer GPUs on {layout.trainer_nodes} node(s)"
    fsdp = Transfer("fsdp all-gather", layout.fsdp_transport, policy, f"among the {trainers}")
    if design == "s3":
        nodes = math.ceil(shape.workers * shape.gpus_per_worker / GPUS_PER_NODE)
        return (
            Transfer("state hand-off", S3, handoff, "step pods, driver and ranks ↔ S3"),
            fsdp,
            Transfer("weights to the engines", S3, engines, f"S3 → rollout pod, {nodes} nodes"),
            Transfer("engine reload", DISK, policy, "each engine node's disk → its GPUs"),
            Transfer("trees", S3, trees, "rollout step → S3 → update step"),
        )
    near = layout.engines_beside_trainers
    return (
        fsdp,
        Transfer(
            "weight broadcast",
            layout.sync_transport,
            policy,
            f"trainer rank 0 → {near} engines on its node, {shape.workers - near} on "
            f"{layout.engine_nodes} other node(s)",
        ),
        Transfer("trees", S3, trees, "driver → S3 → trainers"),
        Transfer(
            "checkpoint",
            S3,
            handoff,
            f"trainer rank 0 → S3, every {CHECKPOINT_EVERY} iterations (its share)",
        ),
    )


@dataclass(frozen=True)
class IterationCost:
    model: str
    """A Qwen3 size: 1.7b, 8b, 14b."""
    design: str
    """s3 or resident (module docstring)."""
    policy_bytes: float
    optimizer_bytes: float
    s3_bytes: float
    """Every copy of the design (module docstring); a checkpoint's, its per-iteration share."""
    s3_s: float
    """On the critical path (a checkpoint's share included)."""
    update_io_s: float
    """The part of ``s3_s`` the update spends moving policy and optimizer state."""
    reload_s: float
    """New weights into every engine: download and reload (s3), broadcast (resident)."""
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
    transfers: tuple[Transfer, ...] = ()
    """Its transfers and the transport each takes (module docstring)."""
    layout: RunLayout | None = None
    """Where the shape's GPUs land."""

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
        policy, optimizer = 2 * params, 12 * params  # bf16; two fp32 moments + fp32 master
        trees_bytes = 8.0 * (stream.generated_tokens.sum() + stream.observation_tokens.sum())
        nodes = math.ceil(shape.workers * shape.gpus_per_worker / GPUS_PER_NODE)
        common = {
            "model": model,
            "policy_bytes": policy,
            "optimizer_bytes": optimizer,
            "image_pull_s": IMAGE_BYTES / PULL_BYTES_S,
            "rollout_s": sim.makespan_s,
            "rollout_utilisation": sim.utilisation,
            "update_s": 8 * params * train_tokens / (shape.update_gpus * GPU_FLOPS * UPDATE_MFU),
            "generated_tokens": sim.generated_tokens,
            "train_tokens": train_tokens,
            "roots": int(np.count_nonzero(stream.parent < 0)),
            "continuations": float(
                stream.branch.sum() / max(np.count_nonzero(stream.parent < 0), 1)
            ),
        }
        state = policy + optimizer
        ranks = shape.update_gpus

        def parallel(copies: int, size: float) -> float:
            """``copies`` pods each moving ``size`` at once, bounded by the S3 service."""
            return max(size / S3_POD_BYTES_S, copies * size / S3_CLUSTER_BYTES_S)

        # s3: the copies in the order the module docstring lists them.
        serial = (2 * policy + optimizer) + (optimizer + trees_bytes) + state + 2 * state
        serial += state + state  # KFP pod's download, its launcher's upload
        update_io = serial / S3_POD_BYTES_S + parallel(ranks, state)
        rollout_read = policy / S3_POD_BYTES_S + parallel(nodes, policy)
        out.append(
            IterationCost(
                design="s3",
                s3_bytes=float(serial + ranks * state + (1 + nodes) * policy + 2 * trees_bytes),
                s3_s=update_io + rollout_read + 2 * trees_bytes / S3_POD_BYTES_S,
                update_io_s=update_io,
                reload_s=RELOAD_FIXED_S + policy / (RELOAD_BYTES_S * shape.gpus_per_worker),
                pods_s=2 * STEP_POD_S,  # the rollout step's pod, then the update step's
                transfers=transfers(
                    shape,
                    "s3",
                    policy,
                    serial + ranks * state,
                    (1 + nodes) * policy,
                    2 * trees_bytes,
                ),
                layout=RunLayout.of(shape),
                **common,  # type: ignore[arg-type]
            )
        )
        # Rank 0 writes it all, one stream, in the background while the next rollout runs:
        # only what outlasts that rollout holds up the next update.
        checkpoint_s = max(0.0, state / S3_POD_BYTES_S - sim.makespan_s) / CHECKPOINT_EVERY
        out.append(
            IterationCost(
                design="resident",
                s3_bytes=float(3 * trees_bytes + state / CHECKPOINT_EVERY),
                s3_s=3 * trees_bytes / S3_POD_BYTES_S + checkpoint_s,
                update_io_s=checkpoint_s,
                reload_s=SYNC_FIXED_S + policy / NCCL_BYTES_S,
                pods_s=STEP_POD_S,  # one iteration step
                transfers=transfers(
                    shape, "resident", policy, state / CHECKPOINT_EVERY, 0.0, 3 * trees_bytes
                ),
                layout=RunLayout.of(shape),
                **common,  # type: ignore[arg-type]
            )
        )
    return out


@dataclass(frozen=True)
class StalenessCost:
    """A resident iteration in steady state at ``max_staleness`` k (module docstring)."""

    model: str
    rollout_s: float
    fit_s: float
    update_s: float
    sync_s: float
    """New weights into the engines: the broadcast (``IterationCost.reload_s``)."""
    fixed_s: float
    """Whatever k: the step pod and the trees' S3 traffic."""
    checkpoint_write_s: float
    """One checkpoint's upload from trainer rank 0, every ``CHECKPOINT_EVERY`` iterations."""

    def _sides(self, k: int) -> tuple[float, float, float]:
        """(driver and engines' side, trainers' side, a checkpoint's hold on the trainers) at k."""
        if k == 0:  # the update starts after the rollout: the upload overlaps that rollout
            hold = max(0.0, self.checkpoint_write_s - self.rollout_s)
            return self.fit_s, self.update_s, hold
        return self.fit_s + self.rollout_s, self.update_s, self.checkpoint_write_s

    def checkpoint_s(self, k: int) -> float:
        """The checkpoint's share per iteration: what its hold adds, over ``CHECKPOINT_EVERY``."""
        engines, trainers, hold = self._sides(k)
        return (max(engines, trainers + hold) - max(engines, trainers)) / CHECKPOINT_EVERY

    def iteration_s(self, k: int) -> float:
        engines, trainers, _ = self._sides(k)
        serial = self.rollout_s if k == 0 else 0.0
        return serial + max(engines, trainers) + self.sync_s + self.fixed_s + self.checkpoint_s(k)

    def speedup(self, k: int) -> float:
        """Iterations at k = 0 over iterations at k."""
        return self.iteration_s(0) / self.iteration_s(k)

    @property
    def bound(self) -> str:
        """What sets the pace at k >= 1: the update or the fit and rollout."""
        return "update" if self.update_s >= self.fit_s + self.rollout_s else "rollout"

    def to_json(self) -> dict[str, object]:
        return {
            **asdict(self),
            "iteration_s": {str(k): self.iteration_s(k) for k in STALENESS},
            "checkpoint_s": {str(k): self.checkpoint_s(k) for k in STALENESS},
            "speedup": {str(k): self.speedup(k) for k in STALENESS if k},
            "bound": self.bound,
        }


def staleness_costs(rows: Sequence[IterationCost]) -> list[StalenessCost]:
    """The resident rows of ``run_iteration_cost`` at k = 0, 1, 2."""
    return [
        StalenessCost(
            model=r.model,
            rollout_s=r.rollout_s,
            fit_s=FIT_S,
            update_s=r.update_s,
            sync_s=r.reload_s,
            fixed_s=r.pods_s + r.s3_s - r.update_io_s,  # update_io_s: the checkpoint's share
            checkpoint_write_s=(r.policy_bytes + r.optimizer_bytes) / S3_POD_BYTES_S,
        )
        for r in rows
        if r.design == "resident"
    ]
