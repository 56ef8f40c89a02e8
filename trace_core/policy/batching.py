"""Paths into padded batches, and passes the ranks of a data-parallel update agree on.

    batch = collate_paths(paths, pad_id)               # right-padded, shifted for next-token
    for part in pack([len(p.tokens) for p in paths], micro_tokens): ...
    passes = agreed_passes(len(parts), device)         # the most any rank runs

Under FSDP every forward all-gathers and every backward reduce-scatters, so every rank must run
the same number of passes in every phase; ranks with fewer pad with ``padding_pass``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from trace_core.algo.advantage import PathTokens

UPSTREAM = (
    "torch.distributed.is_available()",
    "torch.distributed.is_initialized()",
    "torch.distributed.get_world_size()",
    "torch.distributed.get_backend()",
    "torch.distributed.all_reduce(tensor, /, op)",
    "torch.distributed.ReduceOp.MAX",
)
"""What this module calls in torch (``policy.upstream``: entry syntax there)."""


@dataclass(frozen=True)
class PathBatch:
    """Right-padded paths, aligned for next-token prediction: column t predicts ids[:, t+1]."""

    ids: torch.Tensor  # (P, T) long
    attention: torch.Tensor  # (P, T) long, 1 on real tokens
    mask: torch.Tensor  # (P, T-1) bool, True where ids[:, t+1] was generated
    advantages: torch.Tensor  # (P, T-1) float32
    old_logprobs: torch.Tensor  # (P, T-1) float32, π_old of ids[:, t+1] (the PPO ratio's)
    engine_logprobs: torch.Tensor  # (P, T-1) float32, sampling logprob of ids[:, t+1]

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def collate_paths(
    paths: Sequence[PathTokens],
    pad_id: int,
    old: Sequence[npt.NDArray[np.float32]] | None = None,
) -> PathBatch:
    """Pad paths on the right into one batch (padding is masked out of the loss). ``old``: π_old
    per path, aligned with ``path.logprobs`` (``trainer_logprobs``); None: the engine's."""
    if not paths:
        raise ValueError("no paths to collate")
    if old is not None and len(old) != len(paths):
        raise ValueError(f"{len(old)} old logprob arrays for {len(paths)} paths")
    length = max(len(p.tokens) for p in paths)
    ids = torch.full((len(paths), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(paths), length), dtype=torch.long)
    mask = torch.zeros((len(paths), length), dtype=torch.bool)
    adv = torch.zeros((len(paths), length), dtype=torch.float32)
    engine = torch.zeros((len(paths), length), dtype=torch.float32)
    for row, path in enumerate(paths):
        n = len(path.tokens)
        ids[row, :n] = torch.from_numpy(path.tokens.astype(np.int64))
        attention[row, :n] = 1
        mask[row, :n] = torch.from_numpy(path.loss_mask)
        adv[row, :n] = torch.from_numpy(path.advantages.astype(np.float32))
        engine[row, :n] = torch.from_numpy(path.logprobs)
    trainer = engine
    if old is not None:
        trainer = torch.zeros_like(engine)
        for row, values in enumerate(old):
            trainer[row, : len(values)] = torch.from_numpy(values)
    # Column t of the logits predicts token t+1: shift every per-token field by one.
    return PathBatch(ids, attention, mask[:, 1:], adv[:, 1:], trainer[:, 1:], engine[:, 1:])


def micro_batches(paths: Sequence[PathTokens], budget: int) -> list[list[PathTokens]]:
    """``paths`` cut into micro-batches of at most ``budget`` padded tokens (``pack``)."""
    return [[paths[i] for i in part] for part in pack([len(p.tokens) for p in paths], budget)]


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of sequences of ``lengths`` in groups of at most ``budget`` padded tokens
    (rows × longest row), longest first so that rows of a group have similar lengths; 0: one
    group. A sequence longer than the budget goes alone (a sequence is never split)."""
    if budget <= 0 or not lengths:
        return [list(range(len(lengths)))] if lengths else []
    out: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        longest = lengths[out[-1][0]] if out[-1] else lengths[i]
        if out[-1] and longest * (len(out[-1]) + 1) > budget:
            out.append([])
        out[-1].append(i)
    return out


def agreed_passes(passes: int, device: torch.device) -> int:
    """The most passes any rank has to run (an all-reduce of the maximum; ``passes`` itself
    outside a process group).

    Under FSDP every forward all-gathers and every backward reduce-scatters, so all ranks must
    run the same number of passes or the one with fewer waits for ever in its next collective
    (DDP's gradient all-reduce has the same exposure). Ranks hold different paths of different
    lengths, so their micro-batch counts differ: they agree on the maximum and the ranks with
    fewer pad with passes of zero weight (``padding_pass``), as verl does.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return passes
    if torch.distributed.get_world_size() == 1:
        return passes
    # NCCL reduces device tensors only; gloo host tensors.
    on = device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    count = torch.tensor([passes], dtype=torch.int64, device=on)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())


def padding_pass(
    scorer: torch.nn.Module, path: PathTokens, pad_id: int, device: torch.device
) -> torch.Tensor:
    """A pass that moves nothing: ``path`` (one this rank holds) scored and multiplied by 0.
    It runs every collective a real pass runs, over every parameter (the decoder and the
    head), so that the ranks' collectives pair up; its gradient is exactly zero."""
    batch = collate_paths([path], pad_id)
    mask = batch.mask.to(device)
    if not bool(mask.any()):  # the head must run too: score at least one position
        mask = torch.ones_like(mask)
    return scorer(batch.ids.to(device), batch.attention.to(device), mask).sum() * 0.0
