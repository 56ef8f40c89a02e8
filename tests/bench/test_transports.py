"""``bench iteration-cost``'s transports: where a shape's GPUs land as the run's placement group
puts them (the trainers' one bundle on one node, the engines beside them, then on further
nodes of 8), and the transport each transfer takes from there."""

from __future__ import annotations

import pytest

from trace_core.bench.iteration_cost import (
    CHECKPOINT_EVERY,
    DISK,
    NETWORK,
    NVLINK,
    S3,
    SHAPES,
    ClusterShape,
    RunLayout,
    transfers,
)


def shape(trainers: int, engines: int, gpus: int = 1) -> ClusterShape:
    return ClusterShape(workers=engines, gpus_per_worker=gpus, roots=64, update_gpus=trainers)


@pytest.mark.parametrize(
    ("trainers", "engines", "layout", "sync", "fsdp"),
    [
        (4, 4, RunLayout(1, 4, 0), NVLINK, NVLINK),  # one node: NVLink and shared memory
        (4, 12, RunLayout(1, 4, 1), f"{NVLINK}+{NETWORK}", NVLINK),  # the rest fill a node
        (8, 8, RunLayout(1, 0, 1), NETWORK, NVLINK),  # Qwen3-1.7B's: the trainers fill theirs
        (2, 1, RunLayout(1, 1, 0), NVLINK, NVLINK),
        (16, 16, RunLayout(2, 0, 2), NETWORK, NETWORK),  # beyond one node: over the network
        (12, 6, RunLayout(2, 4, 1), NETWORK, NETWORK),  # rank 0's node is all trainers
    ],
)
def test_where_a_shapes_gpus_land_and_what_each_transfer_takes(
    trainers: int, engines: int, layout: RunLayout, sync: str, fsdp: str
) -> None:
    placed = RunLayout.of(shape(trainers, engines))
    assert placed == layout
    assert (placed.sync_transport, placed.fsdp_transport) == (sync, fsdp)
    resident = {
        t.name: t for t in transfers(shape(trainers, engines), "resident", 2e9, 1e9, 0, 5e6)
    }
    assert resident["weight broadcast"].transport == sync
    assert resident["fsdp all-gather"].transport == fsdp
    assert (
        f"{layout.engines_beside_trainers} engines on its node"
        in resident["weight broadcast"].where
    )


def test_tensor_parallel_engines_fill_a_node_whole_engines_at_a_time() -> None:
    assert RunLayout.of(shape(4, 3, gpus=2)) == RunLayout(1, 2, 1)  # 4 + 2×2 here, 1×2 beyond


def test_each_design_lists_its_transfers_by_transport() -> None:
    one_node = shape(4, 4)
    s3 = transfers(one_node, "s3", 2e9, 50e9, 6e9, 4e6)
    assert [(t.name, t.transport) for t in s3] == [
        ("state hand-off", S3),
        ("fsdp all-gather", NVLINK),
        ("weights to the engines", S3),
        ("engine reload", DISK),
        ("trees", S3),
    ]
    assert [t.bytes for t in s3] == [50e9, 2e9, 6e9, 2e9, 4e6]
    resident = transfers(one_node, "resident", 2e9, 14e9 / CHECKPOINT_EVERY, 0.0, 6e6)
    assert [(t.name, t.transport, t.bytes) for t in resident] == [
        ("fsdp all-gather", NVLINK, 2e9),
        ("weight broadcast", NVLINK, 2e9),
        ("trees", S3, 6e6),
        ("checkpoint", S3, 14e9 / CHECKPOINT_EVERY),
    ]


def test_the_recommended_shapes_broadcast_over_the_network() -> None:
    """Every shape of the command fills its trainers' nodes with trainers: the broadcast
    crosses to other nodes (at ``NCCL_BYTES_S``, as the sync's seconds assume); only the 1.7B
    trainers fit in one node, where FSDP gathers over NVLink."""
    layouts = {model: RunLayout.of(s) for model, s in SHAPES.items()}
    assert {m: (x.sync_transport, x.fsdp_transport) for m, x in layouts.items()} == {
        "1.7b": (NETWORK, NVLINK),
        "8b": (NETWORK, NETWORK),
        "14b": (NETWORK, NETWORK),
    }
