"""The policy update: a PPO-clip / GRPO loss over rollout trees, in plain torch.

Each root-to-leaf path of every tree becomes one training sequence, laid out exactly as it
was sampled (``algo.advantage.path_token_advantages``): prompt, then per turn the generated
tokens and the observation tokens. Only generated tokens are learned; the advantage on them
comes from one of the foundation's estimators (``grpo``, ``drgrpo``, ``treepo``, ``treerl``).

Per generated token t, with ρ_t = exp(log π_θ(t) − log π_old(t)):

    loss_t = −min(ρ_t · A_t, clip(ρ_t, 1 − ε, 1 + ε) · A_t) + β · k3_t
    k3_t   = exp(log π_ref(t) − log π_θ(t)) − (log π_ref(t) − log π_θ(t)) − 1

and the minibatch loss is the mean over its generated tokens (token-level averaging, as in
DAPO and Dr. GRPO: a long turn weighs by its length, not as one sequence). The old logprobs
are the engine's sampling logprobs, stored on the tree — no second forward pass. They are
log-softmax of the raw logits, so they are π_old only for rollouts sampled at temperature 1
without top-p — the training loop refuses any other rollout sampling — and the tests check
that they match a recomputation with the training forward pass (``UpdateStats.logprob_gap``
reports the gap on every update).

    from trace_core.policy.update_config import UpdateConfig
    from trace_core.policy.update import update_policy
    stats = update_policy(model, optimizer, trees, UpdateConfig(estimator="grpo"), rng)

Departures, stated plainly: paths that carry no advantage on any token (every leaf of the
group had the same reward) are dropped from the policy-gradient batch by default
(``skip_flat_paths``), which changes the token normaliser exactly as DAPO's dynamic sampling
does; with ``kl_coef > 0`` such paths would still carry a KL term, so they are then kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from trace_core.algo.advantage import (
    PathTokens,
    path_token_advantages,
    turn_advantages,
)
from trace_core.algo.tree import RolloutTree
from trace_core.policy.checkpoint import check_safetensors
from trace_core.policy.update_config import UpdateConfig


@dataclass(frozen=True)
class PathBatch:
    """Right-padded paths, aligned for next-token prediction: column t predicts ids[:, t+1]."""

    ids: torch.Tensor  # (P, T) long
    attention: torch.Tensor  # (P, T) long, 1 on real tokens
    mask: torch.Tensor  # (P, T-1) bool, True where ids[:, t+1] was generated
    advantages: torch.Tensor  # (P, T-1) float32
    old_logprobs: torch.Tensor  # (P, T-1) float32, sampling logprob of ids[:, t+1]

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar, what is minimised
    policy: torch.Tensor  # scalar, the clipped surrogate part
    kl: torch.Tensor  # scalar, mean k3 (0 without a reference)
    clip_fraction: torch.Tensor  # scalar, share of tokens whose ratio was clipped
    ratio: torch.Tensor  # scalar, mean ρ


@dataclass(frozen=True)
class UpdateStats:
    paths: int
    """Paths trained on (after dropping flat ones)."""
    tokens: int
    """Generated tokens trained on."""
    steps: int
    """Optimizer steps taken."""
    loss: float
    kl: float
    clip_fraction: float
    grad_norm: float
    """Mean gradient norm before clipping."""
    logprob_gap: float
    """Mean |log π_θ − log π_old| on the first minibatch, before any step: how far the
    engine's sampling logprobs are from the trainer's recomputation (should be ~0)."""

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


def tree_paths(trees: Sequence[RolloutTree], estimator: str) -> list[PathTokens]:
    """Every root-to-leaf path of every tree with its per-token advantages."""
    paths = []
    for tree in trees:
        adv = turn_advantages(tree, estimator)
        paths += [
            path_token_advantages(tree, int(leaf), adv) for leaf in np.flatnonzero(tree.leaf_mask)
        ]
    return paths


def collate_paths(paths: Sequence[PathTokens], pad_id: int) -> PathBatch:
    """Pad paths on the right into one batch (padding is masked out of the loss)."""
    if not paths:
        raise ValueError("no paths to collate")
    length = max(len(p.tokens) for p in paths)
    ids = torch.full((len(paths), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(paths), length), dtype=torch.long)
    mask = torch.zeros((len(paths), length), dtype=torch.bool)
    adv = torch.zeros((len(paths), length), dtype=torch.float32)
    old = torch.zeros((len(paths), length), dtype=torch.float32)
    for row, path in enumerate(paths):
        n = len(path.tokens)
        ids[row, :n] = torch.from_numpy(path.tokens.astype(np.int64))
        attention[row, :n] = 1
        mask[row, :n] = torch.from_numpy(path.loss_mask)
        adv[row, :n] = torch.from_numpy(path.advantages.astype(np.float32))
        old[row, :n] = torch.from_numpy(path.logprobs)
    # Column t of the logits predicts token t+1: shift every per-token field by one.
    return PathBatch(ids, attention, mask[:, 1:], adv[:, 1:], old[:, 1:])


def token_logprobs(
    model: PreTrainedModel, ids: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    """log π(ids[:, t+1] | ids[:, :t+1]) for every t: (P, T-1)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # (P, T-1, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """The clipped surrogate plus β·k3, averaged over the masked tokens. All inputs (P, T)."""
    maskf = mask.float()
    count = maskf.sum().clamp(min=1.0)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    policy = -(torch.minimum(unclipped, clipped) * maskf).sum() / count
    kl = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if ref_logprobs is not None and kl_coef > 0:
        delta = ref_logprobs - logprobs
        kl = ((torch.exp(delta) - delta - 1.0) * maskf).sum() / count
    with torch.no_grad():
        clip_fraction = (((ratio - 1.0).abs() > clip).float() * maskf).sum() / count
        mean_ratio = (ratio * maskf).sum() / count
    return LossParts(policy + kl_coef * kl, policy, kl, clip_fraction, mean_ratio)


def make_optimizer(model: PreTrainedModel, config: UpdateConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def update_policy(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    trees: Sequence[RolloutTree],
    config: UpdateConfig,
    rng: np.random.Generator,
    pad_id: int = 0,
    reference: PreTrainedModel | None = None,
    rank: int = 0,
    world: int = 1,
) -> UpdateStats:
    """One policy update on ``trees``, in place; the model is left in eval mode.

    Data-parallel (``world`` > 1, the model wrapped in DDP, which averages gradients): every
    rank holds all the trees and the same ``rng`` state, draws the same minibatches, and
    trains on the slice ``minibatch[rank::world]``. Its loss is its token sum divided by the
    minibatch's token count over all ranks, times ``world``, so DDP's average is exactly the
    single-process token mean: one worker or many, the same step up to float rounding.
    """
    if config.kl_coef > 0 and reference is None:
        raise ValueError("kl_coef > 0 needs a reference model")
    paths = tree_paths(trees, config.estimator)
    if config.skip_flat_paths and config.kl_coef == 0:
        paths = [p for p in paths if np.any(p.advantages != 0)]
    if not paths:
        return UpdateStats(0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    device = next(model.parameters()).device
    model.train()
    losses, kls, clips, norms = [], [], [], []
    gap = math.nan
    tokens = 0
    for _ in range(config.epochs):
        order = rng.permutation(len(paths))
        for start in range(0, len(paths), config.minibatch):
            picked = order[start : start + config.minibatch]
            if len(picked) < world:  # every rank needs a slice; all ranks skip it alike
                continue
            minibatch_tokens = sum(int(paths[i].loss_mask[1:].sum()) for i in picked)
            batch = collate_paths([paths[i] for i in picked[rank::world]], pad_id)
            ids, attention = batch.ids.to(device), batch.attention.to(device)
            mask = batch.mask.to(device)
            logprobs = token_logprobs(model, ids, attention)
            old = batch.old_logprobs.to(device)
            if math.isnan(gap):
                gap = float(
                    ((logprobs.detach() - old).abs() * mask).sum() / mask.sum().clamp(min=1)
                )
            ref = None
            if reference is not None and config.kl_coef > 0:
                with torch.no_grad():
                    ref = token_logprobs(reference, ids, attention)
            parts = policy_loss(
                logprobs, old, batch.advantages.to(device), mask, config.clip, ref, config.kl_coef
            )
            share = batch.tokens * world / max(minibatch_tokens, 1)  # 1 on a single process
            optimizer.zero_grad(set_to_none=True)
            (parts.loss * share).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            losses.append(float(parts.loss.detach()))
            kls.append(float(parts.kl.detach()))
            clips.append(float(parts.clip_fraction))
            norms.append(float(norm))
            tokens += batch.tokens
    model.eval()
    return UpdateStats(
        paths=len(paths),
        tokens=tokens // config.epochs,
        steps=len(losses),
        loss=float(np.mean(losses)),
        kl=float(np.mean(kls)),
        clip_fraction=float(np.mean(clips)),
        grad_norm=float(np.mean(norms)),
        logprob_gap=gap,
    )


# --- optimizer state as safetensors (resumable runs never unpickle) ----------------------
def save_optimizer(optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """AdamW's moments and step counts as tensors; the hyper-parameters in the metadata."""
    state = optimizer.state_dict()
    tensors = {
        f"state.{index}.{key}": value if torch.is_tensor(value) else torch.tensor(value)
        for index, slots in state["state"].items()
        for key, value in slots.items()
    }
    meta = {"param_groups": json.dumps(state["param_groups"])}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), meta)


def load_optimizer(optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """AdamW moments ``save_optimizer`` wrote; a missing, damaged or foreign file is named."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no optimizer state (a run's optimizer.safetensors)")
    check_safetensors(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            groups = json.loads((f.metadata() or {})["param_groups"])
            for group in groups:  # JSON turned tuples (AdamW's betas) into lists
                group.update(
                    {k: tuple(v) for k, v in group.items() if isinstance(v, list) and k != "params"}
                )
            state: dict[int, dict[str, torch.Tensor]] = {}
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = f.get_tensor(name)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{path}: not this policy's optimizer state ({type(err).__name__}: {err})"
        ) from None
