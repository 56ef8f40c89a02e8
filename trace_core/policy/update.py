"""The policy update: a PPO-clip / GRPO loss over rollout trees, in plain torch.

Each root-to-leaf path of every tree becomes one training sequence, laid out exactly as it
was sampled (``algo.advantage.path_token_advantages``): prompt, then per turn the generated
tokens and the observation tokens. Only generated tokens are learned; the advantage on them
comes from one of the foundation's estimators (``grpo``, ``drgrpo``, ``treepo``, ``treerl``).

Per generated token t, with ρ_t = exp(log π_θ(t) − log π_old(t)):

    loss_t = −w_t · min(ρ_t · A_t, clip(ρ_t, 1 − ε, 1 + ε) · A_t) + β · k3_t
    k3_t   = exp(log π_ref(t) − log π_θ(t)) − (log π_ref(t) − log π_θ(t)) − 1

and the minibatch loss is the mean over its generated tokens (token-level averaging, as in
DAPO and Dr. GRPO: a long turn weighs by its length, not as one sequence).

π_old (``UpdateConfig.old_logprobs``) is the engine's sampling logprobs stored on the tree
("engine": log-softmax of the raw logits, so π_old only at temperature 1 without top-p, which
the loop enforces; in float32 on CPU the tests check they match the training forward), or the
trainer's own no-grad forward before the first step ("recompute": in bf16 or with vLLM's kernels
they differ); "auto" recomputes unless the model is float32 on CPU. ``logprob_gap`` reports
|trainer − engine| either way. w_t is 1, or with truncated importance sampling (``tis_cap`` C,
Yao et al. 2025) min(exp(log π_trainer_old − log π_engine), C), detached: it corrects for the
engine having sampled while the ratio stays the trainer's.

    from trace_core.policy.update_config import UpdateConfig
    from trace_core.policy.update import update_policy
    stats = update_policy(model, optimizer, trees, UpdateConfig(estimator="grpo"), rng)

Departures, stated plainly: paths that carry no advantage on any token (every leaf of the
group had the same reward) are dropped from the policy-gradient batch by default
(``skip_flat_paths``), which changes the token normaliser exactly as DAPO's dynamic sampling
does; with ``kl_coef > 0`` such paths would still carry a KL term, so they are then kept.
Not yet measured on a GPU: how much recompute and TIS change learning with vLLM in bf16.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trace_core.algo.advantage import (
    PathTokens,
    path_token_advantages,
    turn_advantages,
)
from trace_core.algo.tree import RolloutTree
from trace_core.policy.batching import PathBatch as PathBatch
from trace_core.policy.batching import agreed_passes as agreed_passes
from trace_core.policy.batching import collate_paths as collate_paths
from trace_core.policy.batching import micro_batches as micro_batches
from trace_core.policy.batching import pack as pack
from trace_core.policy.batching import padding_pass as padding_pass
from trace_core.policy.model import dtype_name
from trace_core.policy.optimizer_state import load_optimizer as load_optimizer
from trace_core.policy.optimizer_state import save_optimizer as save_optimizer
from trace_core.policy.peak import measure_peak, release_freed_memory
from trace_core.policy.update_config import UpdateConfig

_Wrapped = torch.nn.parallel.DistributedDataParallel
"""A scorer under data-parallel training (``train.trainer_group``)."""

UPSTREAM = (
    "torch.autocast(device_type, /, dtype, enabled)",
    "torch.utils.checkpoint.checkpoint(function, /, use_reentrant)",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.DistributedDataParallel.module",
    "torch.nn.parallel.DistributedDataParallel.no_sync()",
    "torch.nn.utils.clip_grad_norm_(parameters, max_norm, /)",
    "torch.optim.AdamW(params, /, lr, weight_decay)",
    "torch.optim.Optimizer.zero_grad(set_to_none)",
    "torch.optim.Optimizer.step()",
    "transformers.PreTrainedModel.get_output_embeddings()",
    "transformers.PreTrainedModel.base_model",
    # The policies' decoder (Qwen3), called by name; its layers are what checkpointing wraps.
    "transformers.models.qwen3.modeling_qwen3.Qwen3Model.forward(input_ids, attention_mask, "
    "use_cache)",
    "transformers.models.qwen3.modeling_qwen3.Qwen3Model.layers",
)
"""What this module calls in torch and transformers (``policy.upstream``: entry syntax there;
the collectives of a data-parallel update are ``policy.batching``'s)."""


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
    """Mean |log π_θ − log π_engine| on the first minibatch, before any step: how far the
    engine's sampling logprobs are from the trainer's forward (~0 in float32 on CPU; with
    ``old_recomputed`` the ratio does not see it)."""
    logprob_gap_max: float = 0.0
    """The largest of those gaps."""
    passes: int = 0
    """Forward/backward passes (micro-batches) over all steps."""
    peak_gib: float = 0.0
    """Peak memory of the update (``policy.peak``): CUDA's max allocated, or on CPU the
    process's peak RSS from the update's start (the model and optimizer state included)."""
    held_gib: float = 0.0
    """What the process held when the update began (allocated on CUDA, RSS on CPU): the
    update's own part is ``peak_gib - held_gib``."""
    old_recomputed: bool = False
    """π_old was the trainer's recomputation (``old_logprobs`` recompute, or auto on a model
    that is not float32 on CPU, or TIS); False: the engine's sampling logprobs."""
    tis_weight: float = 1.0
    """Mean truncated importance weight min(π_trainer_old / π_engine, tis_cap) over the tokens
    trained on (1 without TIS)."""
    tis_truncated: float = 0.0
    """Share of those tokens whose weight was cut to ``tis_cap`` (0 without TIS)."""
    master_dtype: str = "float32"
    """The dtype of the weights the optimizer stepped (float32 whatever the checkpoint's:
    ``policy.model.load_for_training``)."""
    compute_dtype: str = "float32"
    """The dtype of the forward and backward arithmetic: bfloat16 under CUDA autocast, else
    the weights' own."""

    def as_dict(self) -> dict[str, float | str]:
        return {k: v if isinstance(v, str) else float(v) for k, v in self.__dict__.items()}


def tree_paths(trees: Sequence[RolloutTree], estimator: str) -> list[PathTokens]:
    """Every root-to-leaf path of every tree with its per-token advantages."""
    paths = []
    for tree in trees:
        adv = turn_advantages(tree, estimator)
        paths += [
            path_token_advantages(tree, int(leaf), adv) for leaf in np.flatnonzero(tree.leaf_mask)
        ]
    return paths


class TokenScorer(torch.nn.Module):
    """log π(generated tokens) of a causal LM, without full-vocabulary fp32 logits.

    ``forward(ids, attention, mask)`` runs the decoder once over the padded batch, takes the
    hidden states of the positions that predict a generated token (``mask``, (P, T-1)), and
    projects them to the vocabulary ``chunk`` tokens at a time. Each chunk's logits are
    recomputed in the backward pass (activation checkpointing) rather than kept, so a
    micro-batch holds one chunk's logits, not (P, T, V) of them: at 2k tokens and Qwen3's
    151,936-token vocabulary that is ≈0.3 GB per 512-token chunk instead of ≈1.2 GB per row.
    Prompt and observation positions never reach the head at all.

    On CUDA the forward runs under bf16 autocast over the fp32 (master) weights; logits are
    upcast to fp32 before the softmax. A module, so that DDP can wrap it (``train.trainer_group``).
    No KV cache is built: every pass scores whole sequences.
    """

    def __init__(self, model: PreTrainedModel, chunk: int = 512) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model = model
        self.chunk = chunk

    def forward(
        self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """(N,) logprobs of ``ids[:, 1:][mask]``, in row-major order of ``mask``."""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            out = self.model.base_model(input_ids=ids, attention_mask=attention, use_cache=False)
            hidden = out.last_hidden_state[:, :-1][mask]  # (N, C)
        targets = ids[:, 1:][mask]  # (N,)
        head = self.model.get_output_embeddings()
        parts = []
        for lo in range(0, len(targets), self.chunk):
            h, t = hidden[lo : lo + self.chunk], targets[lo : lo + self.chunk]
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(head, h, t))
        return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=hidden.is_cuda):
        logits = head(hidden)  # (n, V)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def token_logprobs(
    model: PreTrainedModel, ids: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    """log π(ids[:, t+1] | ids[:, :t+1]) for every t, (P, T-1): the plain full-logits
    definition, for tests and checks (the update uses ``TokenScorer``)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # (P, T-1, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def trainer_logprobs(
    scorer: TokenScorer,
    paths: Sequence[PathTokens],
    micro_tokens: int,
    pad_id: int,
    device: torch.device,
) -> list[npt.NDArray[np.float32]]:
    """The trainer's log π of each path's generated tokens, aligned with ``path.logprobs`` (0
    elsewhere): ``scorer``'s forward under no_grad, in the loss's micro-batches (``pack``) and
    logit chunks, so that a path scored in the same micro-batch gets the same numbers."""
    out: list[npt.NDArray[np.float32]] = [np.zeros(0, np.float32)] * len(paths)
    parts = pack([len(p.tokens) for p in paths], micro_tokens)
    with torch.no_grad():
        for part in parts:
            batch = collate_paths([paths[i] for i in part], pad_id)
            mask = batch.mask.to(device)
            full = torch.zeros(mask.shape, dtype=torch.float32, device=device)  # (P, T-1)
            full[mask] = scorer(batch.ids.to(device), batch.attention.to(device), mask)
            rows = full.cpu().numpy()
            for row, i in enumerate(part):
                n = len(paths[i].tokens)
                out[i] = np.concatenate([np.zeros(1, np.float32), rows[row, : n - 1]])
    return out


def resolve_old_logprobs(mode: str, tis_cap: float, dtype: torch.dtype, device: str) -> str:
    """``UpdateConfig.old_logprobs`` made "engine" or "recompute" for a model whose parameters
    have ``dtype`` on ``device`` (its type: "cpu", "cuda"): "auto" trusts the engine only where
    the trainer does the TorchEngine's arithmetic, float32 on CPU; TIS always recomputes."""
    if mode == "auto":
        same = dtype == torch.float32 and device == "cpu"
        return "engine" if same and tis_cap == 0 else "recompute"
    return mode


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> LossParts:
    """The clipped surrogate plus β·k3, averaged over the masked tokens. All inputs (P, T);
    ``weights``: per-token factors of the surrogate (TIS), taken as constants."""
    maskf = mask.float()
    count = maskf.sum().clamp(min=1.0)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if weights is not None:
        surrogate = surrogate * weights.detach()
    policy = -(surrogate * maskf).sum() / count
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


@dataclass(frozen=True)
class MinibatchStats:
    loss: float
    kl: float
    clip_fraction: float
    gap_sum: float
    """Σ |log π_θ − log π_engine| over this rank's tokens (before the step)."""
    gap_max: float
    tokens: int
    passes: int
    """Forward/backward passes (micro-batches) it took."""
    tis_sum: float = 0.0
    """Σ of the TIS weights over this rank's tokens (0 without TIS)."""
    tis_truncated: int = 0
    """This rank's tokens whose TIS weight was cut to the cap."""


def minibatch_gradients(
    scorer: torch.nn.Module,
    paths: Sequence[PathTokens],
    minibatch_tokens: int,
    config: UpdateConfig,
    pad_id: int,
    device: torch.device,
    reference: TokenScorer | None = None,
    world: int = 1,
    old: Sequence[npt.NDArray[np.float32]] | None = None,
) -> MinibatchStats:
    """Accumulate the gradient of one minibatch's loss (this rank's ``paths``) into ``.grad``,
    one micro-batch of at most ``config.micro_tokens`` padded tokens at a time. ``old``: π_old
    per path (``trainer_logprobs``); None: the engine's sampling logprobs.

    Each micro-batch's token-mean loss is weighted by its share of the minibatch's
    ``minibatch_tokens`` (all ranks), times ``world`` for DDP's average, so the summed
    gradient is the single-pass token mean whatever the split. Under DDP only the last
    micro-batch synchronises (``no_sync`` before it).
    """
    parts_of = pack([len(p.tokens) for p in paths], config.micro_tokens)
    passes = agreed_passes(len(parts_of), device)
    mine = max(sum(int(p.loss_mask[1:].sum()) for p in paths), 1)  # this rank's tokens
    loss = kl = clipped = gap_sum = gap_max = tis_sum = 0.0
    tokens = tis_truncated = 0
    no_sync = scorer.no_sync if isinstance(scorer, _Wrapped) else None  # DDP's; FSDP has none
    for _ in range(len(parts_of), passes):  # a rank with fewer micro-batches: zero-weight passes
        with contextlib.nullcontext() if no_sync is None else no_sync():
            padding_pass(scorer, paths[0], pad_id, device).backward()
    for j, part in enumerate(parts_of):
        part_old = [old[i] for i in part] if old is not None else None
        batch = collate_paths([paths[i] for i in part], pad_id, part_old)
        mask = batch.mask.to(device)
        ids, attention = batch.ids.to(device), batch.attention.to(device)
        last = j == len(parts_of) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            logprobs = scorer(ids, attention, mask)  # (N,)
            old_lp = batch.old_logprobs.to(device)[mask]
            engine = batch.engine_logprobs.to(device)[mask]
            ref = None
            if reference is not None and config.kl_coef > 0:
                with torch.no_grad():
                    ref = reference(ids, attention, mask)
            weights = None
            if config.tis_cap > 0:  # the sampler was the engine: weigh by π_trainer_old / π_engine
                raw = torch.exp(old_lp - engine)
                weights = raw.clamp(max=config.tis_cap)
                tis_sum += float(weights.sum())
                tis_truncated += int((raw > config.tis_cap).sum())
            flat = torch.ones_like(old_lp, dtype=torch.bool)
            advantages = batch.advantages.to(device)[mask]
            parts = policy_loss(
                logprobs, old_lp, advantages, flat, config.clip, ref, config.kl_coef, weights
            )
            share = batch.tokens * world / max(minibatch_tokens, 1)
            (parts.loss * share).backward()
        gap = (logprobs.detach() - engine).abs()
        gap_sum += float(gap.sum())
        gap_max = max(gap_max, float(gap.max()) if gap.numel() else 0.0)
        weight = batch.tokens / mine
        loss += float(parts.loss.detach()) * weight
        kl += float(parts.kl.detach()) * weight
        clipped += float(parts.clip_fraction) * weight
        tokens += batch.tokens
    return MinibatchStats(
        loss, kl, clipped, gap_sum, gap_max, tokens, passes, tis_sum, tis_truncated
    )


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trees: Sequence[RolloutTree],
    config: UpdateConfig,
    rng: np.random.Generator,
    pad_id: int = 0,
    reference: PreTrainedModel | None = None,
    rank: int = 0,
    world: int = 1,
    serving: torch.dtype | None = None,
) -> UpdateStats:
    """One policy update on ``trees``, in place; the model is left in eval mode.

    ``serving``: the dtype the engines that sampled ``trees`` hold the policy in (the
    checkpoint's, ``policy.model.checkpoint_dtype``; None: the model's own). With
    ``old_logprobs`` auto, the engine's logprobs stand for π_old only where its weights are the
    trainer's own: a bf16-served policy is recomputed.

    ``model`` is the HF causal LM, or (data-parallel) a DDP-wrapped ``TokenScorer`` of it.
    Data-parallel (``world`` > 1, DDP averaging gradients): every rank holds all the trees and
    the same ``rng`` state, draws the same minibatches, and trains on the slice
    ``minibatch[rank::world]``. Its loss is its token sum divided by the minibatch's token
    count over all ranks, times ``world``, so DDP's average is exactly the single-process
    token mean: one worker or many, the same step up to float rounding. With π_old recomputed
    (``config.old_logprobs``), each rank scores only the paths of its own slices, before the
    first step and without any collective.
    """
    if config.kl_coef > 0 and reference is None:
        raise ValueError("kl_coef > 0 needs a reference model")
    paths = tree_paths(trees, config.estimator)
    if config.skip_flat_paths and config.kl_coef == 0:
        paths = [p for p in paths if np.any(p.advantages != 0)]
    wrapped = isinstance(model, TokenScorer | _Wrapped)
    scorer = model if wrapped else TokenScorer(model, config.logit_chunk)  # type: ignore[arg-type]
    policy = _policy_of(scorer)
    if not paths:
        dtype = next(policy.parameters()).dtype
        return UpdateStats(
            0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, master_dtype=dtype_name(dtype),
            compute_dtype=compute_dtype(dtype, next(policy.parameters()).device),
        )  # fmt: skip
    ref_scorer = TokenScorer(reference, config.logit_chunk) if reference is not None else None
    device = next(policy.parameters()).device
    cpu = device.type == "cpu"
    if cpu:  # what the rollout freed goes back first: the update starts from what is live
        release_freed_memory()
    with measure_peak(device) as peak:
        stats = _update_steps(
            scorer, policy, device, ref_scorer, optimizer, paths, config, rng, pad_id, rank, world,
            serving,
        )  # fmt: skip
    if cpu:  # and its own activations after it, for the next phase
        release_freed_memory()
    return replace(stats, peak_gib=peak.gib, held_gib=peak.held_gib)


def _update_steps(
    scorer: torch.nn.Module,
    policy: PreTrainedModel,
    device: torch.device,
    ref_scorer: TokenScorer | None,
    optimizer: torch.optim.Optimizer,
    paths: Sequence[PathTokens],
    config: UpdateConfig,
    rng: np.random.Generator,
    pad_id: int,
    rank: int,
    world: int,
    serving: torch.dtype | None,
) -> UpdateStats:
    """``update_policy``'s epochs of minibatch steps over ``paths`` (``policy``: the model
    inside ``scorer``, on ``device``)."""
    undo = checkpoint_layers(policy) if config.checkpointing else None
    policy.train()
    # Every epoch's minibatches are drawn first (the same draws as one epoch at a time), so
    # that π_old can be recomputed for every path this rank will train on before any step.
    minibatches = []
    for _ in range(config.epochs):
        order = rng.permutation(len(paths))
        for start in range(0, len(paths), config.minibatch):
            picked = order[start : start + config.minibatch]
            if len(picked) >= world:  # every rank needs a slice; all ranks skip it alike
                minibatches.append(picked)
    parameter = next(policy.parameters())
    served = parameter.dtype if serving in (None, parameter.dtype) else serving
    mode = resolve_old_logprobs(
        config.old_logprobs,
        config.tis_cap,
        served,
        parameter.device.type,  # type: ignore[arg-type]
    )
    old = None
    if mode == "recompute":  # π_old by the trainer, before the first step
        old = _recompute_old(
            scorer, paths, minibatches, config.micro_tokens, pad_id, device, rank, world
        )
    losses, kls, clips, norms = [], [], [], []
    gap, gap_max = math.nan, 0.0
    tokens = passes = tis_truncated = 0
    tis_sum = 0.0
    for picked in minibatches:
        mine = [int(i) for i in picked[rank::world]]
        minibatch_tokens = sum(int(paths[i].loss_mask[1:].sum()) for i in picked)
        optimizer.zero_grad(set_to_none=True)
        stats = minibatch_gradients(
            scorer,
            [paths[i] for i in mine],
            minibatch_tokens,
            config,
            pad_id,
            device,
            ref_scorer,
            world,
            [old[i] for i in mine] if old is not None else None,
        )
        if math.isnan(gap):
            gap, gap_max = stats.gap_sum / max(stats.tokens, 1), stats.gap_max
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(stats.loss)
        kls.append(stats.kl)
        clips.append(stats.clip_fraction)
        norms.append(float(norm))
        tokens += stats.tokens
        passes += stats.passes
        tis_sum += stats.tis_sum
        tis_truncated += stats.tis_truncated
    if undo is not None:
        undo()
    policy.eval()
    return UpdateStats(
        paths=len(paths),
        tokens=tokens // config.epochs,
        steps=len(losses),
        loss=float(np.mean(losses)),
        kl=float(np.mean(kls)),
        clip_fraction=float(np.mean(clips)),
        grad_norm=float(np.mean(norms)),
        logprob_gap=gap,
        logprob_gap_max=gap_max,
        passes=passes,
        old_recomputed=old is not None,
        tis_weight=tis_sum / max(tokens, 1) if config.tis_cap > 0 else 1.0,
        tis_truncated=tis_truncated / max(tokens, 1),
        master_dtype=dtype_name(parameter.dtype),
        compute_dtype=compute_dtype(parameter.dtype, device),
    )


def compute_dtype(master: torch.dtype, device: torch.device) -> str:
    """The arithmetic's dtype over ``master`` weights: bf16 autocast on CUDA (``TokenScorer``)."""
    return "bfloat16" if device.type == "cuda" else dtype_name(master)


def checkpoint_layers(policy: PreTrainedModel) -> Callable[[], None]:
    """Gradient checkpointing of every decoder layer; returns the function that undoes it.

    Each layer's ``forward`` is run under ``torch.utils.checkpoint`` (non-reentrant): its
    activations are recomputed in the backward pass instead of kept. Written on torch's public
    API rather than transformers' switch, whose name differs between the releases this project
    runs (``activation_checkpointing_enable`` from transformers 5.24 on, only
    ``gradient_checkpointing_enable`` in the GPU image's 5.20). The layer's ``__call__`` (and so
    FSDP's hooks on it) stays outside the checkpoint, so a sharded layer is gathered before its
    recomputation as before its forward.
    """
    layers = list(getattr(policy.base_model, "layers", ()))
    if not layers:
        raise ValueError(
            f"{type(policy).__name__}: no decoder layers at base_model.layers to checkpoint; "
            "set checkpointing false"
        )
    before = [layer.__dict__.get("forward") for layer in layers]  # an instance's own, if any
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)

    def undo() -> None:
        for layer, forward in zip(layers, before, strict=True):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward

    return undo


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _recompute_old(
    scorer: torch.nn.Module,
    paths: Sequence[PathTokens],
    minibatches: Sequence[npt.NDArray[np.int64]],
    micro_tokens: int,
    pad_id: int,
    device: torch.device,
    rank: int,
    world: int,
) -> dict[int, npt.NDArray[np.float32]]:
    """π_old by the trainer of every path this rank trains on (index → ``trainer_logprobs``),
    before any step. Slice by slice, so that the first epoch's passes are the loss's own; with
    the bare scorer, not DDP's wrapper: ranks score different paths, with no collective."""
    own = _scorer_of(scorer)
    old: dict[int, npt.NDArray[np.float32]] = {}
    for picked in minibatches:
        new = [int(i) for i in picked[rank::world] if int(i) not in old]
        # Under FSDP a no-grad forward all-gathers too: the ranks agree on their pass count
        # before any pass, and the ones with fewer pad.
        passes = len(pack([len(paths[i].tokens) for i in new], micro_tokens))
        agreed = agreed_passes(passes, device)
        scored = trainer_logprobs(own, [paths[i] for i in new], micro_tokens, pad_id, device)
        old.update(zip(new, scored, strict=True))
        with torch.no_grad():
            for _ in range(passes, agreed):
                padding_pass(own, paths[int(picked[rank])], pad_id, device)
    return old


def _scorer_of(scorer: torch.nn.Module) -> TokenScorer:
    inner = scorer.module if isinstance(scorer, _Wrapped) else scorer
    assert isinstance(inner, TokenScorer), "update_policy takes a model or a DDP TokenScorer"
    return inner


def _policy_of(scorer: torch.nn.Module) -> PreTrainedModel:
    return _scorer_of(scorer).model
