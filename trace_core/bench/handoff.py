"""``trace-rl bench handoff``: the same iterations with the training state resident on Ray and
with it handed through S3 every iteration, on one in-process Ray and a SeaweedFS on 127.0.0.1.

    trace-rl bench handoff --checkpoint build/models/smollm2 --iterations 3 --json handoff.json

Each mode grows the trees of K iterations with engine actors, fits the predictor, updates the
policy on trainer actors and puts the new weights into the engines; the trees, predictor and
metrics of every iteration go to the store in both. What differs:

* ``resident``: the trainer actors start once and keep the fp32 weights, AdamW's state and the
  reference; new weights reach the engines by broadcast (``policy.weight_sync``); the policy
  and optimizer are written to the store once, as the run's last checkpoint.
* ``s3``: every iteration starts fresh trainer actors that download the policy, optimizer
  state and master weights, read the trees back from the store, upload their result, and the
  engines download the new policy and reload it: the design the pipeline's steps use today,
  and a resident run's recovery path.

Per iteration: ``s3_bytes`` (read plus written by every process, counted by ``S3Store``:
``store.artifacts.TRAFFIC``), ``sync_seconds`` (new weights into every engine: the broadcast,
or the download and reload), ``iteration_seconds``, and whether it wrote a checkpoint. The
seeds are the same in both modes, so both grow the same first iteration.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_core.store.artifacts import TRAFFIC

if TYPE_CHECKING:
    from trace_core.store.server import SeaweedServer

MODES = ("resident", "s3")
GOALS = {"s3_share": 0.02, "sync_speedup": 10.0, "iteration_speedup": 1.3}
"""The goals: a resident iteration without a checkpoint moves ≤ 2% of the policy's bytes
through S3; its sync is ≥ 10× faster than the S3 mode's load of new weights; its iteration
≥ 1.3× faster (SmolLM2-135M)."""


@dataclass(frozen=True)
class HandoffBenchConfig:
    checkpoint: Path
    iterations: int = 3
    engines: int = 1
    """Engine actors (TorchEngine, one CPU thread each)."""
    trainers: int = 1
    """Trainer actors (DDP over gloo when more than one)."""
    task: str = "calc"
    budget: int = 8
    max_tokens: int = 16
    seed: int = 0


@dataclass
class IterationFigures:
    iteration: int
    s3_bytes: int
    sync_seconds: float
    iteration_seconds: float
    checkpoint: bool


@dataclass
class HandoffResult:
    config: dict[str, object]
    policy_bytes: int
    modes: dict[str, list[IterationFigures]] = field(default_factory=dict)

    def ratios(self) -> dict[str, float]:
        """Resident against S3, over iterations without a checkpoint (resident) and all (S3)."""
        plain = [f for f in self.modes["resident"] if not f.checkpoint]
        s3 = self.modes["s3"]

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else float("nan")

        return {
            "s3_share": mean([f.s3_bytes / self.policy_bytes for f in plain]),
            "sync_speedup": mean([f.sync_seconds for f in s3])
            / mean([f.sync_seconds for f in plain]),
            "iteration_speedup": mean([f.iteration_seconds for f in s3])
            / mean([f.iteration_seconds for f in plain]),
        }

    def as_dict(self) -> dict[str, object]:
        return {
            "config": self.config,
            "policy_bytes": self.policy_bytes,
            "modes": {m: [asdict(f) for f in figures] for m, figures in self.modes.items()},
            "ratios": self.ratios(),
            "goals": GOALS,
        }


def run_handoff_bench(
    config: HandoffBenchConfig,
    progress: Callable[[str], None] | None = None,
    server: SeaweedServer | None = None,
) -> HandoffResult:
    """Both modes on one SeaweedFS (``server``, with the bucket ``trace``; None: one started
    here) and one in-process Ray. Each run writes under a prefix of its own."""
    from trace_core.policy.model import checkpoint_dtype
    from trace_core.rollout.ray_pool import ray_session
    from trace_core.store.server import SeaweedServer

    say = progress or (lambda _m: None)
    serving = checkpoint_dtype(config.checkpoint)
    params = _parameters(config.checkpoint)
    result = HandoffResult(
        {**asdict(config), "checkpoint": str(config.checkpoint)}, params * serving.itemsize
    )
    run = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="trace-handoff-") as scratch:
        own = server is None
        if server is None:
            server = SeaweedServer.start(Path(scratch) / "s3", buckets=("trace",))
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())  # before Ray starts: its workers inherit it
        try:
            with ray_session(num_cpus=max(4, config.engines + config.trainers + 1)):
                for mode in MODES:
                    say(f"{mode}: starting")
                    root = f"s3://trace/handoff-{run}/{mode}"
                    result.modes[mode] = _run_mode(config, mode, root, Path(scratch), say)
        finally:
            if own:
                server.stop()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return result


def _run_mode(
    config: HandoffBenchConfig, mode: str, root: str, scratch: Path, say: Callable[[str], None]
) -> list[IterationFigures]:
    from trace_core.envs.suites import make_suite
    from trace_core.policy.checkpoint import load_tokenizer
    from trace_core.policy.update_config import UpdateConfig
    from trace_core.rollout.engine_config import EngineConfig
    from trace_core.rollout.engines import EngineSession
    from trace_core.store.artifacts import open_store
    from trace_core.store.schema import read_trees, write_trees
    from trace_core.store.sync import upload_folder
    from trace_core.train import iteration
    from trace_core.train.config import TrainConfig
    from trace_core.train.draws import draw_iteration
    from trace_core.train.start_state import StartState
    from trace_core.train.trainer_group import TrainerGroup, TrainerSpec

    store = open_store(root)
    upload_folder(config.checkpoint, f"{root}/policy-0000")
    train = TrainConfig(
        task=config.task,
        init=str(config.checkpoint),
        budget=config.budget,
        continuations=2,
        prompts=64,
        max_tokens=config.max_tokens,
        seed=config.seed,
        engine=EngineConfig(workers=config.engines),
        # Every path trained, advantage or not: the update's compute and AdamW's state are
        # there even when the policy never succeeds (un-fine-tuned SmolLM2 on calc).
        update=UpdateConfig(lr=1e-6, minibatch=16, skip_flat_paths=False),
    )
    suite = make_suite(config.task, None, config.seed)
    tasks = suite.tasks("train")
    tokenizer = load_tokenizer(config.checkpoint)
    predictor = iteration.new_predictor(train, tokenizer)
    spec = TrainerSpec(train.update, workers=config.trainers)
    figures: list[IterationFigures] = []
    with EngineSession(train.engine) as session:
        policy = f"{root}/policy-0000"
        with session.engine(policy):  # the engines start (and download) before the clock
            pass
        pool = session.pool
        assert pool is not None
        trainers = TrainerGroup(spec, StartState(policy)) if mode == "resident" else None
        try:
            label = policy
            for i in range(1, config.iterations + 1):
                say(f"{mode}: iteration {i}/{config.iterations}")
                actors = pool.sync_members()[0]
                before = _traffic(actors, trainers)
                start = time.perf_counter()
                draws = draw_iteration(config.seed, i, len(tasks), train.prompts)
                rollout = iteration.roll_out(
                    label, tasks, suite, predictor, train, i, draws, run_id=mode,
                    tokenizer=tokenizer, session=session,
                )  # fmt: skip
                folder = _fresh(scratch / mode / f"{i:04d}")
                write_trees(folder / "trees.parquet", rollout.trees)
                store.put_file(f"iterations/{i:04d}/trees.parquet", folder / "trees.parquet")
                iteration.fit_predictor(predictor, rollout.trees, draws)
                predictor.save(folder / "predictor")
                upload_folder(folder / "predictor", f"{root}/iterations/{i:04d}/predictor")
                store.put_bytes(
                    f"iterations/{i:04d}/metrics.json",
                    json.dumps(rollout.metrics.as_dict()).encode(),
                )
                last = i == config.iterations
                if trainers is not None:
                    trainers.update(rollout.trees, draws.update_seed)
                    sync_start = time.perf_counter()
                    label = f"sync:handoff:{i}"
                    engines, pids = pool.sync_members()
                    pool.synced(label, trainers.sync(engines, pids, label))
                    session.synced(label, 0.0)
                    sync = time.perf_counter() - sync_start
                    if last:
                        trainers.save(f"{root}/checkpoint-{i:04d}")
                    after = _traffic(actors, trainers)
                else:
                    got = folder / "read-back"  # the update step reads the trees from S3
                    store.get_file(f"iterations/{i:04d}/trees.parquet", _fresh(got) / "trees")
                    trees = read_trees(got / "trees")
                    previous = f"{root}/checkpoint-{i - 1:04d}" if i > 1 else None
                    fresh = TrainerGroup(
                        spec,
                        StartState(
                            f"{previous}/policy" if previous else policy,
                            optimizer=f"{previous}/optimizer.safetensors" if previous else None,
                            master=previous if previous and _has_master(store, i - 1) else None,
                        ),
                    )
                    try:
                        fresh.update(trees, draws.update_seed)
                        fresh.save(f"{root}/checkpoint-{i:04d}")
                        trainer_traffic = _traffic([], fresh)
                    finally:
                        fresh.close()
                    label = f"{root}/checkpoint-{i:04d}/policy"
                    sync_start = time.perf_counter()
                    with session.engine(label):  # every engine downloads it and reloads
                        pass
                    sync = time.perf_counter() - sync_start
                    after = _traffic(actors, None)
                    after = (after[0] + trainer_traffic[0], after[1] + trainer_traffic[1])
                seconds = time.perf_counter() - start
                moved = (after[0] - before[0]) + (after[1] - before[1])
                checkpoint = mode == "s3" or last
                figures.append(IterationFigures(i, moved, sync, seconds, checkpoint))
        finally:
            if trainers is not None:
                trainers.close()
    return figures


def _fresh(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _has_master(store: Any, i: int) -> bool:
    return bool(store.exists(f"checkpoint-{i:04d}/master.safetensors"))


def _traffic(engines: list[Any], trainers: Any) -> tuple[int, int]:
    """Bytes read and written through ``S3Store`` by this process and the actors."""
    import ray

    read, written = TRAFFIC.snapshot()
    refs = [e.traffic.remote() for e in engines]
    if trainers is not None:
        refs += [r.traffic.remote() for r in trainers.ranks]
    for r, w, _ in ray.get(refs):
        read, written = read + r, written + w
    return read, written


def _parameters(checkpoint: Path) -> int:
    """Parameters of the checkpoint's weight files (tied tensors once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= int(d)
                total += n
    return total
