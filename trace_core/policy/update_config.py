"""The policy update's settings, importable without torch: they travel inside the training
config through every pipeline step (``train.config``), and only ``policy.update`` acts on them."""

from __future__ import annotations

from dataclasses import dataclass

from trace_core.algo.advantage import ESTIMATORS

OLD_LOGPROBS = ("auto", "engine", "recompute")
"""Where π_old of the PPO ratio comes from (``UpdateConfig.old_logprobs``)."""


@dataclass(frozen=True)
class UpdateConfig:
    estimator: str = "grpo"
    """Advantage estimator: grpo, drgrpo, treepo or treerl."""
    lr: float = 1e-4
    """AdamW learning rate (the optimizer is the caller's; see ``make_optimizer``). On the calc
    warm start, 10 iterations of every strategy (3 seeds) ended higher on mean@4 at 1e-4 than
    at 2e-4 (trace 0.481 vs 0.427, grpo 0.457 vs 0.432), and 2e-4 lost greedy accuracy
    (pass@1 0.67 → 0.54–0.61; 1e-4: 0.63–0.66)."""
    clip: float = 0.2
    """PPO clip range ε: ratios outside [1 − ε, 1 + ε] stop pushing."""
    kl_coef: float = 0.0
    """β of the k3 KL estimate to the reference policy (0: no reference needed)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    minibatch: int = 64
    """Paths per optimizer step."""
    epochs: int = 1
    """Passes over the paths (1 and one minibatch is the on-policy gradient)."""
    skip_flat_paths: bool = True
    """Drop paths whose advantages are all zero (they carry no policy gradient)."""
    weight_decay: float = 0.0
    micro_tokens: int = 0
    """Padded tokens (rows × longest row) of one forward/backward pass; a minibatch's
    gradient is accumulated over as many passes as it needs (the same gradient). 0: the whole
    minibatch in one pass."""
    logit_chunk: int = 512
    """Generated tokens whose vocabulary logits are materialised at once (``TokenScorer``)."""
    checkpointing: bool = False
    """Gradient checkpointing of the decoder layers: recompute activations in the backward
    pass instead of keeping them (≈1/3 more compute, activations of one layer at a time)."""
    old_logprobs: str = "auto"
    """π_old of the PPO ratio: engine (the sampling logprobs stored on the trees), recompute
    (the trainer's own no-grad forward over every path before the first step, in the loss's
    micro-batches: one more forward pass, and the ratio no longer sees the engine's bf16 or
    kernel differences), or auto (engine when the model is float32 on CPU, the TorchEngine's
    arithmetic; recompute otherwise: bf16/fp16 parameters or a GPU)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (Yao et al. 2025) cap C; 0: off. Each token's clipped
    surrogate is weighted by min(π_trainer_old / π_engine, C), detached, where π_trainer_old is
    the recomputed π_old (so TIS always recomputes; it refuses old_logprobs engine): the PPO
    ratio is taken against the trainer's π_old and the weight corrects for the engine having
    sampled. The KL term is not weighted. Yao et al. use C = 2."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"estimator must be one of {', '.join(ESTIMATORS)}; got {self.estimator!r}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 < self.clip < 1:
            raise ValueError(f"clip must be in (0, 1), got {self.clip}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
        if self.minibatch < 1 or self.epochs < 1:
            raise ValueError("minibatch and epochs must be >= 1")
        if self.micro_tokens < 0:
            raise ValueError(
                f"micro_tokens must be >= 0 (0: no micro-batching), got {self.micro_tokens}"
            )
        if self.logit_chunk < 1:
            raise ValueError(f"logit_chunk must be >= 1, got {self.logit_chunk}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}; got {self.old_logprobs!r}"
            )
        if not (self.tis_cap == 0 or 1 <= self.tis_cap < float("inf")):
            raise ValueError(
                f"tis_cap must be 0 (off) or a finite cap >= 1 (below 1 it would down-weight "
                f"tokens the engine and trainer agree on), got {self.tis_cap}"
            )
        if self.tis_cap > 0 and self.old_logprobs == "engine":
            raise ValueError(
                "tis_cap > 0 weighs tokens by the trainer's recomputed π_old: set old_logprobs "
                "to recompute or auto, not engine"
            )
