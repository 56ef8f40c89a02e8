"""The sync group that carries new weights from their source to the engine actors: trainer
rank 0 (``train.trainer_group``), or this process's model (``LocalSource``: the update ran
here). Rank 0 is the source, then each engine actor's processes (``build_sync``); its backend
follows where they all are (NCCL, CUDA IPC or gloo: ``policy.weight_sync.choose_backend``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from trace_core.policy.weight_sync import BUCKET_BYTES
from trace_core.rollout.waits import Wait, get

UPSTREAM = (
    "ray.util.get_node_ip_address()",
    "ray.actor.ActorMethod.remote",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""
SYNC_WAIT_S = 900.0
"""How long a sync waits for the engine actors: above the sync group's own 600 s timeout
(``weight_sync.sync_group``), for an actor alive but stuck before it reaches the group."""


def _engines(what: str, count: int) -> Wait:
    return Wait("engine workers", range(count), what, SYNC_WAIT_S, "SYNC_WAIT_S")


class LocalSource:
    """This process's model as the sync source (the update ran here, the engines are actors):
    this process hosts the store and is rank 0 of the sync group."""

    def __init__(self, model: Any, serving: Any, bucket_bytes: int = BUCKET_BYTES) -> None:
        from trace_core.policy.weight_sync import weight_plan

        self.model = model
        self.plan = weight_plan(model, serving, bucket_bytes)
        self._members: list[int] = []
        self._store: Any = None
        self._backend = "gloo"
        self.sync_seconds = 0.0

    def sync(self, engines: Sequence[Any], pids: Sequence[int], label: str) -> float:
        from trace_core.policy.weight_sync import device_id, send_weights, staging_device

        start = time.perf_counter()
        device = next(self.model.parameters()).device
        if list(pids) != self._members:
            self._group = build_sync(
                self._open, self._join, engines, False, here=True, source=device_id(device)
            )
            self._members = list(pids)
        receives = [e.receive.remote(self.plan, label) for e in engines]
        send_weights(self.model, self.plan, self._group, staging_device(self._backend, device))
        get(receives, _engines(f"the weights of {label}", len(engines)))
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        return seconds

    def _open(self, size: int) -> tuple[str, int]:
        from trace_core.policy.weight_sync import open_store

        host = ray.util.get_node_ip_address()
        self._store = open_store(host, size)
        return host, int(self._store.port)

    def _join(self, host: str, port: int, size: int, backend: str) -> Any:
        from trace_core.policy.weight_sync import sync_group

        self._backend = backend
        return sync_group(host, port, 0, size, backend, store=self._store)


def build_sync(
    open_sync: Any,
    join_sync: Any,
    engines: Sequence[Any],
    local: bool,
    here: bool = False,
    source: str | None = None,
) -> Any:
    """A new sync group: rank 0 is the source (``open_sync``/``join_sync``: an actor's remote
    methods, or with ``here`` this process's; ``source``: its GPU's UUID, None on a CPU), then
    the engine actors' processes (one per actor, or each of a vLLM engine's workers) and, with
    ``local``, this process last. Its backend follows where they all are (``choose_backend``:
    NCCL, CUDA IPC or gloo). Every member joins at once; returns this process's group."""
    from trace_core.policy.weight_sync import choose_backend, sync_group

    devices_of = [e.sync_devices.remote() for e in engines]
    per_engine: list[list[str | None]] = get(devices_of, _engines("their devices", len(engines)))
    devices = [source, *(d for members in per_engine for d in members)]
    size = len(devices) + int(local)
    backend = choose_backend(devices + [None] * int(local))  # this process receives on CPU
    if here:
        host, port = open_sync(size)
    else:
        opening = Wait("trainer ranks", [0], "the sync group's store", SYNC_WAIT_S, "SYNC_WAIT_S")
        host, port = get([open_sync.remote(size)], opening)[0]
    joins = [] if here else [join_sync.remote(host, port, size, backend)]
    first = 1
    for engine, members in zip(engines, per_engine, strict=True):
        joins.append(engine.join_sync.remote(host, port, first, size, backend))
        first += len(members)
    group = join_sync(host, port, size, backend) if here else None
    if local:
        group = sync_group(host, port, size - 1, size, backend)
    get(joins, Wait("sync members", range(len(joins)), "joining", SYNC_WAIT_S, "SYNC_WAIT_S"))
    return group
