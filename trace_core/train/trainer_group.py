"""The run's trainers on Ray, resident for the whole run: one actor per training device holding
the fp32 master weights, AdamW's state and the reference policy; new weights go from trainer
rank 0 to the engines by a collective broadcast (``policy.weight_sync``), not through files.

    with TrainerGroup(TrainerSpec(update, workers=2), start) as trainers:
        for i in iterations:
            stats = trainers.update(trees, seed)       # DDP or FSDP over the actors
            trainers.sync(pool, f"sync:{run}:{i}")      # every engine actor, by broadcast
            if checkpoint_due(i):
                trainers.save(folder)                   # rank 0 writes (uploads) it

``torch.distributed`` is initialised once per actor (gloo on CPU, NCCL on GPUs), when the group
starts; the update is ``policy.update.update_policy`` on each rank's slice of every minibatch,
as on Ray Train, so one trainer reproduces the in-process update. Ray Train's ``TorchTrainer``
runs a function to completion and cannot keep this state between iterations, hence plain
actors. The sync group (trainer rank 0 and the engines) is a process group of its own beside
the trainers' default one; it is built on the first sync and again whenever an engine actor
was replaced (its process id changed), and the replacement receives the current weights with
the others.

Checkpoints (``save``) are written by trainer rank 0 in the layout ``trace-rl train`` and the
pipeline use (an HF folder in the serving dtype, ``optimizer.safetensors``, and
``master.safetensors`` when the serving dtype rounds the master weights) into a local folder or
straight to an ``s3://`` prefix; under FSDP every rank gathers and rank 0 writes.

The trainers' devices (one CPU, and one GPU with ``use_gpu``, each) are ONE bundle of a
placement group, so the ranks land on one node (Ray never splits a bundle: NCCL between them
over NVLink and shared memory), reserved all or nothing (``rollout.placement``): in a run's
own group beside its engines' bundles (``placement``: a pipeline run's session, ``trace-rl
train`` with engine actors), else in a group of their own. A group that does not fit within
``place_timeout_s`` is removed and the error names the shortfall; while it waits, a line every
minute says what is pending. Detached trainers (a pipeline run's) hold a lease
(``train.lease``): each call renews it, and with ``idle_exit_s`` they stop themselves, their
group with them, once their run is gone. Every wait on them is
bounded by ``wait_timeout_s`` (``rollout.waits``): a rank alive but stuck (a hung NCCL call, a
frozen node) ends the run with one line naming it and the call.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import remove_placement_group

from trace_core.algo.tree import RolloutTree
from trace_core.policy.update import UpdateStats
from trace_core.policy.update_config import UpdateConfig
from trace_core.policy.weight_sync import (
    BUCKET_BYTES,
    WeightPlan,
    WeightSink,
    apply_weights,
    dial_store,
    open_store,
)
from trace_core.rollout.lease import Lease
from trace_core.rollout.placement import (
    RunPlacement,
    RunShape,
    named_groups,
    reserve_run,
    run_group_name,
)
from trace_core.rollout.waits import Wait, get
from trace_core.store.sync import local_copy
from trace_core.store.uri import is_remote
from trace_core.train.lease import leased
from trace_core.train.start_state import StartState
from trace_core.train.sync_source import LocalSource, build_sync  # noqa: F401 (weights')

UPSTREAM = (
    "ray.remote",
    "ray.actor.ActorClass.options",  # checks its keywords against Ray's table:
    "ray._common.ray_option_utils.actor_options(num_cpus, num_gpus, namespace, lifetime, name, "
    "scheduling_strategy)",
    "ray.util.placement_group.remove_placement_group(placement_group, /)",
    "ray.get_runtime_context()",
    "ray.runtime_context.RuntimeContext.get_assigned_resources()",
    "ray.util.get_node_ip_address()",
    "ray.get(object_refs, /, timeout)",
    "ray.put(value, /)",
    "ray.get_actor(name, /, namespace)",
    "ray.kill(actor, /, no_restart)",
    "ray.exceptions.RayActorError",
    "ray.exceptions.GetTimeoutError",
    "torch.distributed.init_process_group(backend, /, store, rank, world_size)",
    "torch.nn.parallel.DistributedDataParallel(module, /, device_ids)",
    "torch.set_num_threads",
)
"""What this module calls in Ray and torch (``policy.upstream``: entry syntax there)."""

OPTIMIZER = "optimizer.safetensors"
TRAINER_NAMESPACE = "trace-trainers"


@dataclass(frozen=True)
class TrainerSpec:
    """How the trainer group is built."""

    update: UpdateConfig
    workers: int = 1
    use_gpu: bool = False
    """Each trainer takes one GPU (NCCL between them)."""
    fsdp: bool = False
    """Shard the policy and AdamW's state across the trainers (``policy.sharding``)."""
    bucket_bytes: int = BUCKET_BYTES
    """Size of one weight-sync broadcast."""
    idle_exit_s: float = 0.0
    """> 0: a trainer without a call for this long stops itself (``train.lease``)."""
    place_timeout_s: float = 1800.0
    """How long the group waits for its devices, reserved together (``rollout.placement``)."""
    wait_timeout_s: float = 3600.0
    """How long the driver waits for the ranks to answer a call (``TrainConfig``'s)."""


WRITTEN = "written.json"
"""Beside a checkpoint's files, written after them by trainer rank 0: relative path → [size,
sha256] of each (``read_written``)."""


def read_written(folder: str) -> dict[str, tuple[int, str]] | None:
    """The files trainer rank 0 wrote into ``folder`` (a path or URI) with their sizes and
    hashes, once it wrote them all; None before (or if it never finished)."""
    from trace_core.store.artifacts import open_store

    store = open_store(folder)
    if not store.exists(WRITTEN):
        return None
    body = json.loads(store.get_bytes(WRITTEN))
    return {str(k): (int(v[0]), str(v[1])) for k, v in body.items()}


@ray.remote
@leased
class TrainerRank:
    """One training device's rank (see the module docstring). Every call renews its lease
    (``train.lease``): with ``idle_exit_s``, it stops itself once its run is gone."""

    def __init__(self, rank: int, spec: TrainerSpec) -> None:
        import torch

        self.rank, self.spec = rank, spec
        self._scratch = tempfile.TemporaryDirectory(prefix=f"trace-trainer-{rank}-")
        self._sync: Any = None
        self._store: Any = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._saving: Future[dict[str, tuple[int, str]]] | None = None
        self.update_seed: int | None = None  # the last update's: its iteration's own
        threads = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
        torch.set_num_threads(max(1, threads))
        self._lease = Lease()
        self._lease.watch(spec.idle_exit_s, self._writing)

    def renew(self) -> None:
        """Nothing but the call: the lease of a step that runs (``lease.renewing``)."""

    def _writing(self) -> bool:
        """Whether a checkpoint is being written in the background (the lease holds)."""
        return self._saving is not None and not self._saving.done()

    def pid(self) -> int:
        return os.getpid()

    def traffic(self) -> tuple[int, int, int]:
        """Bytes this process read, wrote, and of those moved for checkpoints, through object
        storage (``S3Store``)."""
        from trace_core.store.artifacts import TRAFFIC

        return TRAFFIC.counts()

    def endpoint(self) -> tuple[str, int]:
        """Rank 0's address and the port of the trainers' store, opened here and kept open (a
        port found free now and bound later could be taken in between): where the others dial."""
        host = ray.util.get_node_ip_address()
        store = open_store(host, self.spec.workers) if self.spec.workers > 1 else None
        self._group_store = store
        return host, int(store.port) if store else 0

    def setup(self, host: str, port: int, start: StartState) -> dict[str, object]:
        """Join the trainers' process group and load the state; returns what the driver needs."""
        import torch
        import torch.distributed as dist

        from trace_core.policy.model import (
            MASTER,
            load_checkpoint,
            load_for_training,
            load_master,
        )
        from trace_core.policy.sharding import load_sharded_optimizer, shard_scorer
        from trace_core.policy.tokenizer import padding_id
        from trace_core.policy.update import TokenScorer, load_optimizer, make_optimizer

        spec, world = self.spec, self.spec.workers
        self.device = torch.device("cuda", 0) if spec.use_gpu else torch.device("cpu")
        if world > 1:
            store = getattr(self, "_group_store", None) or dial_store(host, port, world)
            dist.init_process_group(
                "nccl" if spec.use_gpu else "gloo", store=store, rank=self.rank, world_size=world
            )
        self._policy_dir = str(self._local(start.policy, "policy"))
        self.model, tokenizer, self.serving = load_for_training(
            self._policy_dir, device=self.device
        )
        self.pad_id = padding_id(tokenizer)
        self.tokenizer = tokenizer
        if start.master:  # the one file, not the checkpoint folder that holds it
            master = self._local(f"{start.master.rstrip('/')}/{MASTER}", "master", folder=False)
            load_master(self.model, Path(str(master)).parent)
        self.reference = None
        if start.reference and spec.update.kl_coef > 0:
            self.reference, _ = load_checkpoint(
                self._local(start.reference, "reference"), device=self.device
            )
        optimizer_file = self._local(start.optimizer, "optimizer", folder=False)
        scorer: torch.nn.Module = TokenScorer(self.model, spec.update.logit_chunk)
        if spec.fsdp and world > 1:
            scorer = shard_scorer(scorer, self.device.type == "cuda")
            self.optimizer = make_optimizer(self.model, spec.update)
            if optimizer_file:
                load_sharded_optimizer(self.model, self.optimizer, optimizer_file)
        else:
            self.optimizer = make_optimizer(self.model, spec.update)
            if optimizer_file:
                load_optimizer(self.optimizer, optimizer_file)
            if world > 1:
                scorer = torch.nn.parallel.DistributedDataParallel(
                    scorer, device_ids=[0] if spec.use_gpu else None
                )
        self.scorer = scorer if world > 1 else self.model
        return self.info()

    def info(self) -> dict[str, object]:
        """What a driver needs of a running rank (one that finds the group again, too)."""
        params = sum(p.numel() for p in self.model.parameters())
        serving = str(self.serving).removeprefix("torch.")
        return {"parameters": params, "serving": serving, "update_seed": self.update_seed}

    def update(self, trees: Sequence[RolloutTree] | str, seed: int) -> UpdateStats:
        """One update on ``trees``, or on the trees stored below the URI ``trees``."""
        from trace_core.policy.update import update_policy
        from trace_core.store.sync import get_trees

        self._wait_saving()  # the checkpoint being written holds these weights
        self.update_seed = seed  # before any step: a failed update is not one to apply again
        return update_policy(
            self.scorer,
            self.optimizer,
            get_trees(trees) if isinstance(trees, str) else trees,
            self.spec.update,
            np.random.default_rng(seed),
            self.pad_id,
            self.reference,
            rank=self.rank,
            world=self.spec.workers,
            serving=self.serving,
        )

    # -- weight sync (rank 0 is rank 0 of the sync group) ------------------------------------

    def plan(self) -> WeightPlan:
        from trace_core.policy.weight_sync import weight_plan

        return weight_plan(self.model, self.serving, self.spec.bucket_bytes)

    def open_sync(self, size: int) -> tuple[str, int]:
        """Host the sync group's store (rank 0); returns where the engines dial."""
        self._sync = None
        host = ray.util.get_node_ip_address()
        self._store = open_store(host, size)
        return host, int(self._store.port)

    def join_sync(self, host: str, port: int, size: int, backend: str) -> None:
        from trace_core.policy.weight_sync import sync_group

        self._sync = sync_group(host, port, 0, size, backend, store=self._store)
        self._backend = backend

    def sync_device(self) -> str | None:
        """The GPU this rank's weights are on (its UUID), None on a CPU (``choose_backend``)."""
        from trace_core.policy.weight_sync import device_id

        return device_id(self.device)

    def send(self, plan: WeightPlan) -> float:
        """This rank's part of a sync: rank 0 broadcasts, FSDP ranks gather with it."""
        from trace_core.policy.weight_sync import send_weights, staging_device

        if self.rank != 0 and not self.spec.fsdp:
            return 0.0
        start = time.perf_counter()
        device = staging_device(getattr(self, "_backend", "gloo"), self.device)
        send_weights(self.model, plan, self._sync if self.rank == 0 else None, device)
        return time.perf_counter() - start

    # -- checkpoints ------------------------------------------------------------------------

    def save_in_background(self, target: str) -> None:
        """Start ``save(target)`` in a thread of this actor and return; ``saved`` gives its
        files. The weights stay as they are until it is done: ``update`` waits for it first."""
        self._wait_saving()
        self._saving = self._saver.submit(self._write, target)

    def saved(self) -> dict[str, tuple[int, str]] | None:
        """The files of the checkpoint started by ``save_in_background`` once it is written
        (rank 0's; {} on the others), None if none was started; raises what writing it
        raised."""
        future, self._saving = self._saving, None
        return None if future is None else future.result()

    def _wait_saving(self) -> None:
        """Wait for a checkpoint being written; its files (or error) wait for ``saved``."""
        if self._saving is None:
            return
        error = self._saving.exception()
        if error is not None:
            raise RuntimeError(
                f"the checkpoint written in the background failed: {type(error).__name__}: {error}"
            ) from error

    def save_status(self) -> str:
        """The checkpoint started by ``save_in_background``: none, running, done, or failed
        (with why)."""
        future = self._saving
        if future is None:
            return "none"
        if not future.done():
            return "running"
        error = future.exception()
        return "done" if error is None else f"failed: {type(error).__name__}: {error}"

    def save(self, target: str) -> dict[str, tuple[int, str]]:
        """Write the checkpoint (every rank under FSDP; rank 0 writes) to ``target``: a folder
        (its policy in ``target/policy``, the optimizer state and master weights beside it) or
        an ``s3://`` prefix, uploaded from this actor. Returns rank 0's files (relative path →
        size, sha256): a registry checkpoint's manifest, without reading the files back. Its
        transfers count as checkpoint bytes (``Traffic.checkpoint``). One written in the
        background that failed is dropped (this one is written in its place)."""
        if self._saving is not None and self._saving.exception() is not None:  # waits for it
            self._saving = None
        return self._write(target)

    def _write(self, target: str) -> dict[str, tuple[int, str]]:
        from trace_core.store.artifacts import TRAFFIC

        with TRAFFIC.checkpoint():
            return self._save(target)

    def _save(self, target: str) -> dict[str, tuple[int, str]]:
        import torch

        from trace_core.policy.model import load_checkpoint, save_checkpoint, save_master
        from trace_core.policy.sharding import full_weights, save_sharded_optimizer
        from trace_core.policy.update import save_optimizer

        remote = is_remote(target)
        out = Path(self._scratch.name, "save") if remote else Path(target)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        model = self.model
        if self.spec.fsdp and self.spec.workers > 1:
            weights = full_weights(self.model)
            save_sharded_optimizer(self.model, self.optimizer, out / OPTIMIZER, self.rank)
            if self.rank == 0:
                model, _ = load_checkpoint(self._policy_dir, dtype=torch.float32)
                model.load_state_dict(weights)
        elif self.rank == 0:
            save_optimizer(self.optimizer, out / OPTIMIZER)
        if self.rank != 0:
            return {}
        save_checkpoint(model, self.tokenizer, out / "policy", dtype=self.serving)
        save_master(model, out, self.serving)
        from trace_core.store.artifacts import file_sha256

        files = {
            p.relative_to(out).as_posix(): (p.stat().st_size, file_sha256(p))
            for p in sorted(out.rglob("*"))
            if p.is_file()
        }
        # Last, what was written (the registry's commit checks the stored files against it):
        # a step can commit the checkpoint from it should these actors be gone by then.
        listing = json.dumps({k: list(v) for k, v in files.items()}, indent=1)
        if remote:
            import shutil

            from trace_core.store.artifacts import open_store
            from trace_core.store.sync import upload_folder

            upload_folder(out, target)
            shutil.rmtree(out)
            open_store(target).put_bytes(WRITTEN, listing.encode())
        else:
            (out / WRITTEN).write_text(listing)
        return files

    def _local(self, location: str | None, name: str, folder: bool = True) -> str | None:
        """A local copy of an input (the path itself, or its download into scratch)."""
        if location is None:
            return None
        return local_copy(location, Path(self._scratch.name), name, folder)


class TrainerGroup:
    """The driver's handle on the trainer actors (see the module docstring)."""

    def __init__(
        self,
        spec: TrainerSpec,
        start: StartState,
        name: str = "",
        detached: bool = False,
        placement: RunPlacement | None = None,
        say: Callable[[str], None] | None = print,
    ) -> None:
        """``name``: the actors are ``<name>-<rank>`` in the namespace ``TRAINER_NAMESPACE``;
        ``detached``: they outlive this driver (a pipeline step), until ``release_trainers``.
        ``placement``: the run's group, whose trainers' bundle the ranks start in (the run
        frees it); None: a group of their own, reserved here (``say``: its progress)."""
        if spec.workers < 1:
            raise ValueError(f"workers must be >= 1, got {spec.workers}")
        if detached and not name:
            raise ValueError("detached trainers need a name (the next step finds them by it)")
        self.spec, self.name, self.ranks = spec, name, []
        self.reserved: Any = None  # a group of their own, which close() frees
        self.placement = placement
        """The run's group they run in (None: their own, ``reserved``): trainers started again
        after a fault take its trainers' bundle again (``train.weights``)."""
        if placement is None:
            shape = RunShape(trainers=spec.workers, trainer_gpus=spec.use_gpu)
            what = f"the trainers{f' {name}' if name else ''} (train_workers={spec.workers})"
            placement = reserve_run(
                shape, name, detached, spec.place_timeout_s, what, say=say
            )  # all of them or none: two runs never each hold part of the devices
            self.reserved = placement.group
        elif placement.shape.trainers != spec.workers:
            raise ValueError(
                f"train_workers={spec.workers}, but the run's group {placement.name} holds "
                f"{placement.shape.trainers} trainers"
            )
        options: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1 if spec.use_gpu else 0}
        if name:  # found by name: one run's trainers serve no other
            options |= {"namespace": TRAINER_NAMESPACE}
        if detached:
            options |= {"lifetime": "detached"}
        self.ranks = [
            TrainerRank.options(  # type: ignore[attr-defined]
                **options,
                scheduling_strategy=placement.trainer(),
                **({"name": f"{name}-{r}"} if name else {}),
            ).remote(r, spec)
            for r in range(spec.workers)
        ]
        try:
            host, port = self._get([self.ranks[0].endpoint.remote()], "their start", [0])[0]
            infos = self._get([r.setup.remote(host, port, start) for r in self.ranks], "setup")
        except BaseException:
            self.close()
            raise
        self._attached(infos[0])

    def _attached(self, info: dict[str, object]) -> None:
        self.parameters = int(info["parameters"])  # type: ignore[call-overload]
        self.serving = str(info["serving"])
        self.update_seed: int | None = info.get("update_seed")  # type: ignore[assignment]
        """The seed of the last update the trainers applied (``draws.draw_iteration``'s, so
        it names its iteration); None before the first."""
        self._plan: WeightPlan | None = None
        self._members: list[int] = []  # the engines' pids the sync group was built with
        self.sync_seconds = 0.0

    @classmethod
    def find(
        cls, spec: TrainerSpec, name: str, placement: RunPlacement | None = None
    ) -> TrainerGroup | None:
        """The running group ``name`` (started by an earlier step), with its state; None when
        any of its actors is gone (the group is then stopped: its state is incomplete).
        ``placement``: the run's group they run in, if any."""
        ranks = []
        for r in range(spec.workers):
            try:
                ranks.append(ray.get_actor(f"{name}-{r}", namespace=TRAINER_NAMESPACE))
            except ValueError:
                break
        group = cls.__new__(cls)
        group.spec, group.name, group.ranks, group.reserved = spec, name, ranks, None
        group.placement = placement
        if len(ranks) < spec.workers or not group.alive():
            group.close()
            return None
        group._attached(group._get([ranks[0].info.remote()], "info", [0])[0])
        return group

    @property
    def plan(self) -> WeightPlan:
        if self._plan is None:
            self._plan = self._get([self.ranks[0].plan.remote()], "plan", [0])[0]
        return self._plan

    def update(self, trees: Sequence[RolloutTree] | str, seed: int) -> UpdateStats:
        """The ranks' update on ``trees``, or on the trees each reads where the URI ``trees``
        names (``store.sync.put_trees``): the store is the hand-off."""
        # Objects: once in the object store, read by every rank.
        ref = trees if isinstance(trees, str) else ray.put(list(trees))
        refs = [r.update.remote(ref, seed) for r in self.ranks]
        stats: list[UpdateStats] = self._get(refs, f"update (seed {seed})")
        return stats[0]

    def sync(
        self,
        engines: Sequence[Any],
        pids: Sequence[int],
        label: str,
        local: WeightSink | None = None,
    ) -> float:
        """New weights into every engine actor of ``engines`` (``EngineWorker`` handles whose
        processes are ``pids``), which then serve them as ``label``, and into ``local`` (this
        process's model, for an engine in this process); returns wall seconds."""
        start = time.perf_counter()
        plan = self.plan
        members = [*pids, os.getpid() if local is not None else 0]
        if members != self._members:
            source = self._get([self.ranks[0].sync_device.remote()], "sync_device", [0])[0]
            self._group = build_sync(
                self.ranks[0].open_sync, self.ranks[0].join_sync, engines, local is not None,
                source=source,
            )  # fmt: skip
            self._members = members
        sends = [r.send.remote(plan) for r in self.ranks]
        receives = [e.receive.remote(plan, label) for e in engines]
        if local is not None:
            apply_weights(plan, self._group, local)
        ranks, engine_ids = range(len(sends)), range(len(receives))
        names = [*(f"rank {r}" for r in ranks), *(f"engine {e}" for e in engine_ids)]
        self._get(sends + receives, f"sync ({label})", names, who="sync members")
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        return seconds

    def save(self, target: str | Path) -> dict[str, tuple[int, str]]:
        """Checkpoint to ``target`` (a folder or ``s3://`` prefix); rank 0's files (relative
        path → size, sha256)."""
        refs = [r.save.remote(str(target)) for r in self.ranks]
        files: list[dict[str, tuple[int, str]]] = self._get(refs, f"save ({target})")
        return files[0]

    def save_in_background(self, target: str | Path) -> None:
        """Start the checkpoint to ``target`` on the trainer actors and return at once (the
        next rollout runs while they write it); ``saved`` waits for its files. The next update
        waits for it first."""
        refs = [r.save_in_background.remote(str(target)) for r in self.ranks]
        self._get(refs, f"save_in_background ({target})")

    def save_status(self) -> list[str]:
        """Each rank's ``TrainerRank.save_status``."""
        return self._get([r.save_status.remote() for r in self.ranks], "save_status")

    def saved(self) -> dict[str, tuple[int, str]] | None:
        """Rank 0's files of the checkpoint started by ``save_in_background``, once written;
        None when none was started (these actors are not the ones that started it)."""
        refs = [r.saved.remote() for r in self.ranks]
        files: list[dict[str, tuple[int, str]] | None] = self._get(refs, "saved (its checkpoint)")
        return files[0]

    def pids(self) -> list[int]:
        return [int(p) for p in self._get([r.pid.remote() for r in self.ranks], "pid")]

    def _get(
        self,
        refs: list[Any],
        what: str,
        ranks: Sequence[object] | None = None,
        who: str = "trainer ranks",
    ) -> list[Any]:
        """``ray.get(refs)``, the answers of ``ranks`` (default: every rank, in order) to
        ``what``, within ``spec.wait_timeout_s``; past it one line names the ranks that did
        not answer (``rollout.waits``)."""
        names = range(len(refs)) if ranks is None else ranks
        return get(refs, Wait(who, names, what, self.spec.wait_timeout_s, "wait_timeout_s"))

    def alive(self) -> bool:
        """Whether every trainer actor still answers (its state is then intact)."""
        try:
            ray.get([r.pid.remote() for r in self.ranks], timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def close(self) -> None:
        """Stop the trainers and free the devices their group reserved."""
        for rank in getattr(self, "ranks", []):
            with contextlib.suppress(Exception):
                ray.kill(rank, no_restart=True)
        self.ranks = []
        groups = [self.reserved] if getattr(self, "reserved", None) is not None else []
        _remove([*groups, *(named_groups(self.name) if self.name else [])])
        self.reserved = None

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def release_trainers(name: str, workers: int) -> int:
    """Stop the detached trainer actors of ``name`` (the run's last step) and free their
    group's devices; how many ran."""
    stopped = 0
    for r in range(workers):
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(f"{name}-{r}", namespace=TRAINER_NAMESPACE), no_restart=True)
            stopped += 1
    _remove(named_groups(name))
    return stopped


def release_run_group(session: str) -> int:
    """Free the placement group of the run ``session`` (``rollout.placement``: its trainers'
    and engines' devices; an actor still in it stops with it); how many groups there were."""
    groups = named_groups(run_group_name(session))
    _remove(groups)
    return len(groups)


def _remove(groups: Sequence[Any]) -> None:
    for group in groups:
        with contextlib.suppress(Exception):  # removed already
            remove_placement_group(group)
