"""One rank of a data-parallel update, started by tests/policy/test_ranks.py as a process of its
own (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment; gloo on the CPU):

    python tests/policy/ranks_worker.py fsdp|ddp POLICY TREES OUT CONFIG_JSON

Rank 0 writes the updated full weights to OUT/weights.safetensors and the stats to
OUT/stats.json."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from trace_core.policy.model import load_checkpoint
from trace_core.policy.sharding import full_weights, shard_scorer
from trace_core.policy.update import TokenScorer, UpdateConfig, make_optimizer, update_policy
from trace_core.store.schema import read_trees


def main(mode: str, policy: str, trees: str, out: str, config_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = UpdateConfig(**json.loads(config_json))
    model, tokenizer = load_checkpoint(policy)
    if mode == "fsdp":
        scorer: torch.nn.Module = shard_scorer(TokenScorer(model, config.logit_chunk))
        optimizer = make_optimizer(model, config)  # on this rank's shards
    else:
        optimizer = make_optimizer(model, config)
        scorer = torch.nn.parallel.DistributedDataParallel(TokenScorer(model, config.logit_chunk))
    stats = update_policy(
        scorer,
        optimizer,
        read_trees(trees),
        config,
        np.random.default_rng(7),
        tokenizer.pad_token_id,
        rank=rank,
        world=world,
    )
    weights = full_weights(model) if mode == "fsdp" else model.state_dict()
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().clone().contiguous() for k, v in weights.items()},
            f"{out}/weights.safetensors",
        )
        Path(out, "stats.json").write_text(json.dumps(asdict(stats)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    os._exit(0)  # gloo's threads can hold the interpreter's exit
