"""Supervised fine-tuning on token sequences with a loss mask (the warm start's trainer).

A sequence is exactly what a rollout would hold: the prompt, then per turn the generated
tokens and the observation tokens. Only generated tokens are learned (``loss_mask``), so the
policy imitates the agent's turns and never the environment's replies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per step."""
    lr: float = 1.25e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%). On the calc warm start
    (1000 steps) 1.25e-3 ended at loss 0.18–0.20 over three init seeds, 2.5e-3 at 0.20–0.31,
    5e-3 at 0.46–0.58 (its plateaus last hundreds of steps, longer or shorter by seed)."""
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    micro_tokens: int = 0
    """Padded tokens of one forward/backward pass (0: the whole batch at once). With a budget
    the loss goes through the update's ``TokenScorer`` (generated positions only, the head in
    chunks), and the batch's gradient is accumulated over passes: the same token-mean loss."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.micro_tokens < 0:
            raise ValueError(f"micro_tokens must be >= 0, got {self.micro_tokens}")


def _batch(
    sequences: Sequence[npt.NDArray[np.int32]],
    masks: Sequence[npt.NDArray[np.bool_]],
    index: npt.NDArray[np.int64],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T), attention mask (B, T), and targets (B, T-1) with -100 ignored."""
    length = max(len(sequences[i]) for i in index)
    ids = torch.full((len(index), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(index), length), dtype=torch.long)
    learn = torch.zeros((len(index), length), dtype=torch.bool)
    for row, i in enumerate(index):
        n = len(sequences[i])
        ids[row, :n] = torch.from_numpy(np.asarray(sequences[i], dtype=np.int64))
        attention[row, :n] = 1
        learn[row, :n] = torch.from_numpy(np.asarray(masks[i], dtype=bool))
    targets = ids[:, 1:].masked_fill(~learn[:, 1:], -100)  # predict token t+1 where it is generated
    return ids, attention, targets


def sft_train(
    model: PreTrainedModel,
    sequences: Sequence[npt.NDArray[np.int32]],
    loss_masks: Sequence[npt.NDArray[np.bool_]],
    config: SFTConfig,
    pad_id: int,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place; returns the loss of every step.

    Without ``micro_tokens``, a step's sequences share rows where the model keeps packed
    sequences apart (``_rows``): the padded batch's loss and gradient, from fewer positions."""
    if len(sequences) != len(loss_masks) or not sequences:
        raise ValueError("need one loss mask per sequence, and at least one sequence")
    for i, (seq, mask) in enumerate(zip(sequences, loss_masks, strict=True)):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {i}: {len(seq)} tokens but {len(mask)} mask entries")
        if not np.asarray(mask[1:], dtype=bool).any():
            raise ValueError(f"sequence {i} has no token to learn (its mask is False after t=0)")
    device = next(model.parameters()).device
    tokens = [np.asarray(seq, dtype=np.int64) for seq in sequences]
    targets = [_targets(seq, mask) for seq, mask in zip(tokens, loss_masks, strict=True)]
    together = not config.micro_tokens and _keeps_packed_sequences_apart(model, tokens[0])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )

    def lr_at(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        done = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    rng = np.random.default_rng(config.seed)
    model.train()
    losses = []
    for step in range(config.steps):
        index = rng.choice(
            len(sequences), size=min(config.batch_size, len(sequences)), replace=False
        )
        optimizer.zero_grad(set_to_none=True)
        if config.micro_tokens:
            loss = _accumulate(model, sequences, loss_masks, index, pad_id, config.micro_tokens)
        else:
            ids, positions, wanted = _rows(tokens, targets, index, pad_id, together)
            loss = _token_mean_loss(
                model,
                ids.to(device),
                None if positions is None else positions.to(device),
                wanted.to(device),
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if progress:
            progress(step, losses[-1])
    model.eval()
    return losses


def _targets(tokens: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """Per position, the next token where that token is generated, else -100 (ignored); the
    last position predicts nothing."""
    out = np.full(len(tokens), -100, dtype=np.int64)
    learn = np.asarray(mask[1:], dtype=bool)
    out[:-1][learn] = tokens[1:][learn]
    return out


def _first_fit(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of ``width`` tokens: longest first, each into the first
    row with room. A batch of 32 calc demonstrations (63–225 tokens) fills ≈23 rows of its
    longest instead of 32: ≈27% fewer positions through every layer and attention. Wider rows
    hold them in fewer positions still, but each row's attention grows with its square."""
    rows: list[list[int]] = []
    room: list[int] = []
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        k = next((k for k, free in enumerate(room) if free >= lengths[r]), len(rows))
        if k == len(rows):
            rows.append([])
            room.append(width)
        rows[k].append(r)
        room[k] -= lengths[r]
    return rows


def _rows(
    tokens: Sequence[npt.NDArray[np.int64]],
    targets: Sequence[npt.NDArray[np.int64]],
    index: npt.NDArray[np.int64],
    pad_id: int,
    together: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The batch as ids (R, C), positions (R, C) and targets (R, C) in rows as long as its
    longest sequence, padded on the right.

    ``together``: sequences share rows (``_first_fit``), each numbered from position 0, which
    HF reads as packed sequences that never attend to one another; the padding at a row's end
    is numbered from 0 too, a sequence of its own. Otherwise one sequence a row and no
    positions (None): causal attention alone keeps a right-padded row's tokens from its
    padding. Either way every token sees exactly its own sequence's earlier tokens at the same
    positions as alone, so the loss and its gradient are the padded batch's, up to rounding.
    """
    lengths = [len(tokens[i]) for i in index]
    width = max(lengths)
    rows = _first_fit(lengths, width) if together else [[r] for r in range(len(index))]
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    wanted = np.full((len(rows), width), -100, dtype=np.int64)
    for k, row in enumerate(rows):
        at = 0
        for r in row:
            n = lengths[r]
            ids[k, at : at + n] = tokens[index[r]]
            wanted[k, at : at + n] = targets[index[r]]
            positions[k, at : at + n] = np.arange(n)
            at += n
        positions[k, at:] = np.arange(width - at)
    packed = torch.from_numpy(positions) if together else None
    return torch.from_numpy(ids), packed, torch.from_numpy(wanted)


def _token_mean_loss(
    model: PreTrainedModel,
    ids: torch.Tensor,
    positions: torch.Tensor | None,
    targets: torch.Tensor,
) -> torch.Tensor:
    """Mean cross-entropy over the learned targets (``targets != -100``). Only their positions
    reach the output head: a quarter of a calc demonstration's tokens, the rest are prompt,
    observations and padding, whose logits the loss would drop anyway."""
    out = model.base_model(input_ids=ids, position_ids=positions, use_cache=False)
    learn = targets != -100
    logits = model.get_output_embeddings()(out.last_hidden_state[learn])  # (N, V)
    return F.cross_entropy(logits, targets[learn])


def _keeps_packed_sequences_apart(model: PreTrainedModel, tokens: npt.NDArray[np.int64]) -> bool:
    """Whether ``model`` scores ``tokens`` packed behind a copy of themselves in one row
    (positions restarting at 0) as it scores them alone. HF's decoders build the block-diagonal
    mask from the positions; one that does not would let the second sequence attend to the
    first and learn something else, so such a model gets one sequence a row instead (``_rows``).
    """
    device = next(model.parameters()).device
    alone = torch.as_tensor(tokens[:8], device=device)[None]  # (1, n)
    n = alone.shape[1]
    positions = torch.arange(n, device=device).repeat(2)[None]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        single = model.base_model(input_ids=alone, use_cache=False).last_hidden_state
        packed = model.base_model(
            input_ids=alone.repeat(1, 2), position_ids=positions, use_cache=False
        ).last_hidden_state[:, n:]
    model.train(was_training)
    gap = torch.linalg.vector_norm(packed - single)
    return bool(gap <= 1e-3 * torch.linalg.vector_norm(single))


def _accumulate(
    model: PreTrainedModel,
    sequences: Sequence[npt.NDArray[np.int32]],
    loss_masks: Sequence[npt.NDArray[np.bool_]],
    index: npt.NDArray[np.int64],
    pad_id: int,
    budget: int,
) -> torch.Tensor:
    """Backpropagate the batch's token-mean loss in passes of at most ``budget`` padded
    tokens (longest sequences first); returns the loss (detached)."""
    from trace_core.policy.update import TokenScorer, pack

    scorer = TokenScorer(model)
    device = next(model.parameters()).device
    total = sum(int(np.asarray(loss_masks[i][1:]).sum()) for i in index)
    loss = torch.zeros((), device=device)
    for part in pack([len(sequences[i]) for i in index], budget):
        rows = index[np.asarray(part)]
        ids, attention, targets = (
            t.to(device) for t in _batch(sequences, loss_masks, rows, pad_id)
        )
        learn = targets != -100
        part_loss = -scorer(ids, attention, learn).sum() / total
        part_loss.backward()
        loss += part_loss.detach()
    return loss
