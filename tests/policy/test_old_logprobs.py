"""π_old under mixed precision: the engine's logprobs, the trainer's recomputation, and TIS.

The engine here is the TorchEngine in float32, whose logprobs are the trainer's to ~1e-6; a
bf16 or vLLM engine is mimicked by shifting the logprobs stored on the trees."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from trace_core.algo.tree import RolloutTree
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import (
    TokenScorer,
    UpdateConfig,
    UpdateStats,
    policy_loss,
    resolve_old_logprobs,
    tree_paths,
    update_policy,
)
from trace_core.rollout.flat import rollout_flat

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
Weights = dict[str, torch.Tensor]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def rollouts():  # type: ignore[no-untyped-def]
    suite = CalcSuite(seed=2, train_size=16, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    model = create_policy(tokenizer, SMALL, seed=0)
    trees = rollout_flat(
        TorchEngine(model),
        TurnFormat(tokenizer),
        suite.make_env,
        suite.tasks("train")[:8],
        SamplingParams(n=4, max_tokens=10),
        seed=0,
    )
    for tree in trees:  # mixed outcomes, so that every group has advantages to push
        tree.reward[np.flatnonzero(tree.leaf_mask)[:2]] = 1.0
    return model, tokenizer.pad_token_id, trees


def shifted(trees: Sequence[RolloutTree], shift: np.ndarray) -> list[RolloutTree]:
    """``trees`` whose engine logprobs are lowered by ``shift[j % len(shift)]`` at the j-th
    generated token of each node: what an engine with other arithmetic would have stored."""
    out = []
    for tree in trees:
        lowered = tuple(
            (lp - shift[np.arange(len(lp)) % len(shift)]).astype(np.float32) for lp in tree.logprobs
        )
        out.append(replace(tree, logprobs=lowered))
    return out


def noisy(trees: Sequence[RolloutTree], scale: float, seed: int) -> list[RolloutTree]:
    """``trees`` with N(0, scale²) noise on every engine logprob (a bf16-like engine)."""
    return shifted(trees, np.random.default_rng(seed).normal(0.0, scale, size=997))


def train(  # type: ignore[no-untyped-def]
    model,
    trees: Sequence[RolloutTree],
    pad_id: int,
    sgd: bool = False,
    **knobs: object,
) -> tuple[Weights, UpdateStats]:
    """The weights after one update of a copy of ``model`` (several minibatch steps). ``sgd``:
    plain SGD, whose step is linear in the gradient, instead of AdamW's sign-like first step."""
    model = copy.deepcopy(model)
    config = UpdateConfig(**{"lr": 1e-3, "minibatch": 8, **knobs})  # type: ignore[arg-type]
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.5) if sgd else torch.optim.AdamW(params, lr=1e-3)
    stats = update_policy(model, optimizer, trees, config, np.random.default_rng(0), pad_id)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats


def largest_difference(a: Weights, b: Weights) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --- where π_old comes from ---------------------------------------------------------------
def test_auto_is_the_engine_on_a_float32_cpu_model(rollouts) -> None:  # type: ignore[no-untyped-def]
    model, pad_id, trees = rollouts
    auto, auto_stats = train(model, trees, pad_id)
    engine, engine_stats = train(model, trees, pad_id, old_logprobs="engine")
    assert auto_stats.steps > 1  # several minibatches
    assert not auto_stats.old_recomputed and not engine_stats.old_recomputed
    assert auto_stats.tis_weight == 1.0 and auto_stats.tis_truncated == 0.0
    for name, value in engine.items():
        assert torch.equal(auto[name], value), name  # today's update, bit for bit
    memory = {"peak_gib", "held_gib"}  # the process's, not the update's arithmetic
    same = {k: v for k, v in auto_stats.as_dict().items() if k not in memory}
    assert same == {k: v for k, v in engine_stats.as_dict().items() if k not in memory}


def test_recompute_takes_the_engine_gap_out_of_the_ratio(rollouts) -> None:  # type: ignore[no-untyped-def]
    """A bf16-like engine (noise σ = 0.1 on its logprobs): with the trainer's recomputed π_old
    the update is the one the true logprobs give; with the engine's it is not."""
    model, pad_id, trees = rollouts
    bent = noisy(trees, 0.1, seed=3)
    true, true_stats = train(model, trees, pad_id, sgd=True, old_logprobs="engine")
    fixed, fixed_stats = train(model, bent, pad_id, sgd=True, old_logprobs="recompute")
    off, off_stats = train(model, bent, pad_id, sgd=True, old_logprobs="engine")
    assert fixed_stats.old_recomputed and not off_stats.old_recomputed
    assert true_stats.logprob_gap < 1e-4
    # The gap is still reported, against the engine: the noise (E|N(0, 0.1²)| ≈ 0.08).
    assert fixed_stats.logprob_gap > 0.03
    assert fixed_stats.logprob_gap == pytest.approx(off_stats.logprob_gap, rel=1e-4)
    assert largest_difference(fixed, true) < 1e-5
    assert largest_difference(off, true) > 100 * largest_difference(fixed, true)
    assert largest_difference(off, true) > 1e-4
    assert fixed_stats.clip_fraction == pytest.approx(true_stats.clip_fraction, abs=1e-6)


def test_recompute_scores_each_path_once_before_the_first_step(rollouts) -> None:  # type: ignore[no-untyped-def]
    """π_old is π before the update: paths trained on in later steps (and epochs) are scored
    up front, each rank only its own slices (here rank 1 of 2, without DDP)."""
    model, pad_id, trees = rollouts
    model = copy.deepcopy(model)
    scorer = CountingScorer(model)
    config = UpdateConfig(minibatch=8, epochs=2, old_logprobs="recompute")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = update_policy(
        scorer, optimizer, trees, config, np.random.default_rng(0), pad_id, None, 1, 2
    )
    # The same draws: 2 epochs of minibatches of 8, rank 1 takes picked[1::2] of each.
    n = len(tree_paths(trees, "grpo"))
    rng = np.random.default_rng(0)
    orders = [rng.permutation(n) for _ in range(2)]
    mine = {int(i) for order in orders for start in range(0, n, 8) for i in order[start:][:8][1::2]}
    assert stats.steps == 2 * math.ceil(n / 8) and stats.old_recomputed
    assert scorer.no_grad_rows == len(mine) < n  # each of its paths once, no other rank's
    assert scorer.first_grad_call == len(mine)  # all of them before the first loss pass


class CountingScorer(TokenScorer):
    """A ``TokenScorer`` that counts the rows it scores without a gradient, and notes how many
    it had scored when the first gradient pass came."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)  # type: ignore[arg-type]
        self.no_grad_rows = 0
        self.first_grad_call = -1

    def forward(
        self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if torch.is_grad_enabled():
            if self.first_grad_call < 0:
                self.first_grad_call = self.no_grad_rows
        else:
            self.no_grad_rows += len(ids)
        return super().forward(ids, attention, mask)


def test_a_bf16_model_recomputes_on_auto(rollouts) -> None:  # type: ignore[no-untyped-def]
    model, pad_id, trees = rollouts
    half = copy.deepcopy(model).to(torch.bfloat16)
    paths = len(tree_paths(trees, "grpo"))
    _, stats = train(half, trees, pad_id, minibatch=paths)
    assert stats.old_recomputed
    assert stats.logprob_gap > 1e-4  # a bf16 trainer against the float32 engine (fp32: ~5e-8)
    assert stats.clip_fraction == 0.0  # one step against its own forward: every ratio is 1
    _, engine = train(half, trees, pad_id, minibatch=paths, old_logprobs="engine")
    assert not engine.old_recomputed


@pytest.mark.parametrize(
    ("mode", "tis_cap", "dtype", "device", "expected"),
    [
        ("auto", 0.0, torch.float32, "cpu", "engine"),  # the TorchEngine's own arithmetic
        ("auto", 0.0, torch.bfloat16, "cpu", "recompute"),
        ("auto", 0.0, torch.float16, "cpu", "recompute"),
        ("auto", 0.0, torch.float32, "cuda", "recompute"),  # bf16 autocast, other kernels
        ("auto", 2.0, torch.float32, "cpu", "recompute"),  # TIS needs the trainer's π_old
        ("engine", 0.0, torch.bfloat16, "cuda", "engine"),  # asked for: as asked
        ("recompute", 0.0, torch.float32, "cpu", "recompute"),
    ],
)
def test_auto_resolves_from_the_parameters(
    mode: str, tis_cap: float, dtype: torch.dtype, device: str, expected: str
) -> None:
    assert resolve_old_logprobs(mode, tis_cap, dtype, device) == expected


# --- truncated importance sampling ---------------------------------------------------------
def test_tis_weights_the_surrogate_by_hand() -> None:
    # Ratio 1 on three tokens (π_θ = π_old), A = [1, 1, −1], TIS weights [0.5, 2, 2]:
    # surrogate w·ρ·A = [0.5, 2, −2] → loss −(0.5 + 2 − 2)/3 = −1/6,
    # d loss / d log π_θ = −w·A/3 = [−1/6, −2/3, +2/3] (the weights are constants).
    new = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    weights = torch.tensor([[0.5, 2.0, 2.0]], requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    parts = policy_loss(new, new.detach(), adv, mask, 0.2, weights=weights)
    parts.loss.backward()
    assert parts.loss.item() == pytest.approx(-1 / 6)
    assert new.grad is not None and weights.grad is None
    torch.testing.assert_close(new.grad, torch.tensor([[-1 / 6, -2 / 3, 2 / 3]]))


def test_tis_reports_the_truncated_weights_by_hand(rollouts) -> None:  # type: ignore[no-untyped-def]
    """Engine logprobs lowered by s ∈ {−0.5, 0, 0.5, 1.5} in turn: with the trainer's π_old
    ≈ the true logprobs, w = min(exp(s), 2) = 0.607, 1, 1.649, 2 (exp(1.5) = 4.48, truncated)."""
    model, pad_id, trees = rollouts
    shifts = np.array([-0.5, 0.0, 0.5, 1.5])
    bent = shifted(trees, shifts)
    _, stats = train(model, bent, pad_id, epochs=2, tis_cap=2.0)
    assert stats.old_recomputed  # auto with TIS
    true = [p for p in tree_paths(trees, "grpo") if np.any(p.advantages != 0)]
    low = [p for p in tree_paths(bent, "grpo") if np.any(p.advantages != 0)]
    s = np.concatenate(
        [(t.logprobs - b.logprobs)[t.loss_mask] for t, b in zip(true, low, strict=True)]
    )
    assert set(np.round(s, 4)) == set(shifts)
    assert stats.tis_weight == pytest.approx(np.minimum(np.exp(s), 2.0).mean(), rel=1e-4)
    assert stats.tis_truncated == pytest.approx(np.mean(np.isclose(s, 1.5)), abs=1e-12)


def test_tis_is_a_no_op_when_engine_and_trainer_agree(rollouts) -> None:  # type: ignore[no-untyped-def]
    """True logprobs: every weight is exp(~0) = 1, so TIS gives the plain recompute update;
    on the shifted trees the weights change it."""
    model, pad_id, trees = rollouts
    plain, plain_stats = train(model, trees, pad_id, sgd=True, old_logprobs="recompute")
    tis, tis_stats = train(model, trees, pad_id, sgd=True, tis_cap=2.0)
    assert plain_stats.tis_weight == 1.0 and plain_stats.tis_truncated == 0.0
    assert tis_stats.tis_weight == pytest.approx(1.0, abs=1e-4) and tis_stats.tis_truncated == 0
    assert largest_difference(tis, plain) < 1e-5
    bent = shifted(trees, np.array([-0.5, 0.0, 0.5, 1.5]))
    bent_plain, _ = train(model, bent, pad_id, sgd=True, old_logprobs="recompute")
    bent_tis, _ = train(model, bent, pad_id, sgd=True, tis_cap=2.0)
    assert largest_difference(bent_plain, plain) < 1e-5  # the ratio never saw the shift
    assert largest_difference(bent_tis, plain) > 1e-3  # the weights did


# --- the settings, from the command line and the pipeline -----------------------------------
def test_the_fields_reach_the_update_from_settings_json_and_the_command_line(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from trace_core.cli import app
    from trace_core.train.contract import PipelineParameters

    settings = '{"update": {"old_logprobs": "recompute", "tis_cap": 2}}'
    update = PipelineParameters(settings_json=settings).config().train.update
    assert update == UpdateConfig(old_logprobs="recompute", tis_cap=2.0)
    out = tmp_path / "run"
    flags = ["--tis-cap", "2", "--old-logprobs", "engine", "--output", str(out)]
    result = CliRunner().invoke(app, ["train", *flags])
    assert result.exit_code == 2 and result.output.startswith("error:")
    assert "old_logprobs" in result.output and not out.exists()
