"""FSDP for the data-parallel update: parameters, gradients and AdamW's moments sharded across
the ranks (torch's ``fully_shard``), for policies whose replicas do not fit beside their
optimizer state with DDP. The checkpoint and the optimizer file stay the ones a single process
writes, so a run can move between DDP, FSDP and one process from one iteration to the next.

    scorer = shard_scorer(TokenScorer(model, chunk))        # every rank, before the optimizer
    optimizer = make_optimizer(model, config)                # on the shards
    load_sharded_optimizer(model, optimizer, "optimizer.safetensors")
    ... update_policy(scorer, optimizer, ...) ...
    weights = full_weights(model)                            # every rank (a collective)
    save_sharded_optimizer(model, optimizer, path, rank)     # every rank; rank 0 writes

Each decoder block is its own FSDP unit and the scorer the root (it holds the embeddings, the
final norm and the head, tied or not): a block's full weights exist only while it runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from trace_core.policy.optimizer_state import read_optimizer_file, write_optimizer_file

UPSTREAM = (
    "torch.distributed.fsdp.fully_shard(module, /, mp_policy)",
    "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype)",
    "torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict, cpu_offload)",
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, /, options)",
    "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizers, /, "
    "options)",
    "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(model, optimizers, "
    "optim_state_dict, /, options)",
)
"""What this module calls in torch (``policy.upstream``: entry syntax there)."""


def shard_scorer(scorer: torch.nn.Module, bf16: bool = False) -> torch.nn.Module:
    """``scorer`` (a ``TokenScorer``) sharded in place over the default process group.

    The shards hold the float32 master weights. ``bf16`` (on GPUs): each unit's parameters are
    gathered in bfloat16 for its forward and backward and the gradients reduce-scattered in
    float32 (FSDP's mixed precision), so the all-gathers move half the bytes while the
    optimizer still steps fp32 weights with fp32 gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    model = scorer.model  # type: ignore[attr-defined]
    for block in getattr(model.base_model, "layers", ()):
        fully_shard(block, mp_policy=policy)
    fully_shard(scorer, mp_policy=policy)
    return scorer


def full_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the CPU, on every rank (all ranks must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _names(model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's index order (how ``save_optimizer`` keys them)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save_sharded_optimizer(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, path: str | Path, rank: int
) -> None:
    """Gather AdamW's state (all ranks call it) and write it as ``save_optimizer`` would have
    for the unsharded model (rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    full = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return
    names = _names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: slots for name, slots in full["state"].items()}
    groups = [
        {**group, "params": [index[name] for name in group["params"]]}
        for group in full["param_groups"]
    ]
    write_optimizer_file(path, state, groups)


def load_sharded_optimizer(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, path: str | Path
) -> None:
    """Load a ``save_optimizer`` file into the optimizer of a sharded model (every rank)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    state, groups = read_optimizer_file(path)
    names = _names(model, optimizer)
    if len(state) > len(names) or any(i >= len(names) for i in state):
        raise ValueError(
            f"{path}: not this policy's optimizer state ({len(names)} parameters, "
            f"state for index {max(state)})"
        )
    full = {
        "state": {names[i]: slots for i, slots in state.items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in groups
        ],
    }
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
