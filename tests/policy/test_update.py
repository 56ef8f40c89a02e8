"""The policy update: the loss worked out by hand, the engine's logprobs against the trainer's,
and one real update moving probability toward the better paths."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import (
    TokenScorer,
    UpdateConfig,
    checkpoint_layers,
    collate_paths,
    load_optimizer,
    make_optimizer,
    micro_batches,
    minibatch_gradients,
    policy_loss,
    save_optimizer,
    token_logprobs,
    tree_paths,
    update_policy,
)
from trace_core.rollout.flat import rollout_flat

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the loss, by hand -------------------------------------------------------------------
def test_clipped_surrogate_by_hand() -> None:
    # Two tokens, both with ratio 1.5 (log-ratio log 1.5); a third token is masked out.
    # A = +1: min(1.5·1, clip(1.5)=1.2 · 1) = 1.2  → loss −1.2   (clipped: no push past 1.2)
    # A = −1: min(1.5·−1, 1.2·−1) = −1.5          → loss +1.5   (unclipped: the bad move stays)
    old = torch.zeros(1, 3)
    new = torch.full((1, 3), math.log(1.5))
    adv = torch.tensor([[1.0, -1.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    parts = policy_loss(new, old, adv, mask, clip=0.2)
    assert parts.policy.item() == pytest.approx((-1.2 + 1.5) / 2)
    assert parts.clip_fraction.item() == pytest.approx(1.0)  # |1.5 − 1| > 0.2 on both tokens
    assert parts.ratio.item() == pytest.approx(1.5)
    assert parts.kl.item() == 0.0


def test_k3_kl_by_hand() -> None:
    # log π_ref − log π = log 2 on one token: exp(log 2) − log 2 − 1 = 2 − 0.6931 − 1 = 0.3069.
    new = torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2.0), 0.0]])
    mask = torch.tensor([[True, False]])
    parts = policy_loss(new, new, torch.zeros(1, 2), mask, 0.2, ref_logprobs=ref, kl_coef=0.5)
    assert parts.kl.item() == pytest.approx(2 - math.log(2) - 1)
    assert parts.loss.item() == pytest.approx(0.5 * (2 - math.log(2) - 1))
    same = policy_loss(new, new, torch.zeros(1, 2), mask, 0.2, ref_logprobs=new, kl_coef=0.5)
    assert same.kl.item() == 0.0


def test_token_level_average_weights_long_turns_by_length() -> None:
    # Row 0 has 3 learned tokens with A = 1, row 1 has 1 with A = −1, ratio 1 everywhere:
    # token mean = (3·(−1) + 1·(+1)) / 4 = −0.5 (a sequence mean would give (−1 + 1)/2 = 0).
    zeros = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert policy_loss(zeros, zeros, adv, mask, 0.2).loss.item() == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"estimator": "ppo"}, "estimator"),
        ({"lr": 0.0}, "lr"),
        ({"clip": 1.5}, "clip"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"minibatch": 0}, "minibatch"),
        ({"old_logprobs": "trainer"}, "old_logprobs"),
        ({"tis_cap": -1.0}, "tis_cap"),
        ({"tis_cap": 0.5}, "tis_cap"),  # below 1 it would cut weights where the two agree
        ({"tis_cap": math.nan}, "tis_cap"),
        ({"tis_cap": math.inf}, "tis_cap"),
        ({"tis_cap": 2.0, "old_logprobs": "engine"}, "old_logprobs"),  # TIS needs the recompute
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        UpdateConfig(**kwargs)  # type: ignore[arg-type]


# --- on real rollouts ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollouts():  # type: ignore[no-untyped-def]
    suite = CalcSuite(seed=1, train_size=24, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    fmt = TurnFormat(tokenizer)
    model = create_policy(tokenizer, SMALL, seed=0)
    trees = rollout_flat(
        TorchEngine(model),
        fmt,
        suite.make_env,
        suite.tasks("train")[:12],
        SamplingParams(n=4, max_tokens=12),
        seed=0,
    )
    # An untrained policy never answers right; give the trees mixed rewards so every
    # estimator has something to push: the first two leaves of each tree "succeed".
    for tree in trees:
        for leaf in np.flatnonzero(tree.leaf_mask)[:2]:
            tree.reward[leaf] = 1.0
    return model, tokenizer, trees


def test_engine_logprobs_match_the_training_forward(rollouts) -> None:  # type: ignore[no-untyped-def]
    """In float32 on CPU, π_old is read from the tree ("auto" does not recompute it): it must be
    what the trainer computes."""
    model, tokenizer, trees = rollouts
    batch = collate_paths(tree_paths(trees, "grpo"), tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = token_logprobs(model, batch.ids, batch.attention)
    gap = (recomputed - batch.old_logprobs).abs()[batch.mask]
    assert batch.tokens > 100
    assert gap.max().item() < 1e-4


def test_collate_masks_prompt_observations_and_padding(rollouts) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer, trees = rollouts
    paths = tree_paths(trees, "grpo")
    batch = collate_paths(paths, tokenizer.pad_token_id)
    assert batch.tokens == sum(int(p.loss_mask.sum()) for p in paths)
    for row, path in enumerate(paths):
        n = len(path.tokens)
        assert not batch.mask[row, n - 1 :].any()  # padding is never learned
        assert torch.equal(batch.mask[row, : n - 1], torch.from_numpy(path.loss_mask[1:]))


def test_update_moves_probability_toward_rewarded_paths(rollouts) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, trees = rollouts
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        paths = tree_paths(trees, "grpo")
        batch = collate_paths(paths, tokenizer.pad_token_id)
        good = batch.mask & (batch.advantages > 0)
        bad = batch.mask & (batch.advantages < 0)
        config = UpdateConfig(lr=3e-3, minibatch=len(paths))
        stats = update_policy(
            model,
            make_optimizer(model, config),
            trees,
            config,
            np.random.default_rng(0),
            tokenizer.pad_token_id,
        )
        assert stats.steps == 1 and stats.paths == len(paths)
        assert stats.clip_fraction == 0.0  # one on-policy step: every ratio is exactly 1
        assert stats.logprob_gap < 1e-4
        # Its own peak (policy.peak): at least what the process held, the model included.
        assert stats.peak_gib * 2**30 >= sum(p.numel() * 4 for p in model.parameters())
        with torch.no_grad():
            after = token_logprobs(model, batch.ids, batch.attention)
        delta = after - batch.old_logprobs
        assert delta[good].mean() > 0 > delta[bad].mean()
    finally:
        model.load_state_dict(state)


def test_flat_groups_carry_no_gradient_and_are_dropped(rollouts) -> None:  # type: ignore[no-untyped-def]
    model, _, trees = rollouts
    flat = list(trees)
    for tree in flat:
        tree.reward[tree.leaf_mask] = 0.0  # every group all-fail: grpo advantages all zero
    try:
        config = UpdateConfig()
        stats = update_policy(
            model, make_optimizer(model, config), flat, config, np.random.default_rng(0)
        )
        assert stats.paths == 0 and stats.steps == 0
    finally:
        for tree in flat:
            tree.reward[np.flatnonzero(tree.leaf_mask)[:2]] = 1.0


def test_kl_needs_a_reference(rollouts) -> None:  # type: ignore[no-untyped-def]
    model, _, trees = rollouts
    config = UpdateConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="reference"):
        update_policy(model, make_optimizer(model, config), trees, config, np.random.default_rng(0))


def test_optimizer_state_round_trips_through_safetensors(tmp_path, rollouts) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, trees = rollouts
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        config = UpdateConfig(minibatch=8)
        optimizer = make_optimizer(model, config)
        update_policy(
            model, optimizer, trees, config, np.random.default_rng(0), tokenizer.pad_token_id
        )
        save_optimizer(optimizer, tmp_path / "opt.safetensors")
        fresh = make_optimizer(model, config)
        load_optimizer(fresh, tmp_path / "opt.safetensors")
        a, b = optimizer.state_dict(), fresh.state_dict()
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for index, slots in a["state"].items():
            for key, value in slots.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key]))
    finally:
        model.load_state_dict(state)


# --- the memory controls: same gradient, fewer tokens per pass --------------------------------
def gradients(model, paths, config: UpdateConfig, pad_id: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The accumulated gradient of one minibatch holding every path."""
    model.zero_grad(set_to_none=True)
    model.train()
    undo = checkpoint_layers(model) if config.checkpointing else None
    tokens = sum(int(p.loss_mask[1:].sum()) for p in paths)
    stats = minibatch_gradients(
        TokenScorer(model, config.logit_chunk), paths, tokens, config, pad_id, torch.device("cpu")
    )
    if undo is not None:
        undo()
    model.eval()
    assert stats.tokens == tokens
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "knobs",
    [
        {"micro_tokens": 60},  # many passes of a few short rows, one path per pass at the longest
        {"micro_tokens": 1},  # one path per pass
        {"logit_chunk": 7},  # the head in chunks of 7 tokens
        {"checkpointing": True, "micro_tokens": 200},
    ],
    ids=["micro-60", "micro-1", "chunk-7", "checkpointing"],
)
def test_micro_batches_chunks_and_checkpointing_give_the_one_pass_gradient(
    rollouts, knobs: dict[str, object]
) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, trees = rollouts
    paths = tree_paths(trees, "grpo")
    whole = gradients(model, paths, UpdateConfig(), tokenizer.pad_token_id)
    split = gradients(model, paths, UpdateConfig(**knobs), tokenizer.pad_token_id)  # type: ignore[arg-type]
    assert whole.keys() == split.keys() and len(whole) > 3
    for name, g in whole.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(split[name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_micro_batches_respect_the_budget_and_keep_every_path(rollouts) -> None:  # type: ignore[no-untyped-def]
    _, _, trees = rollouts
    paths = tree_paths(trees, "grpo")
    parts = micro_batches(paths, 120)
    assert sorted(id(p) for part in parts for p in part) == sorted(id(p) for p in paths)
    assert len(parts) > 2
    for part in parts:
        longest = max(len(p.tokens) for p in part)
        assert longest * len(part) <= 120 or len(part) == 1
    assert micro_batches(paths, 0) == [list(paths)]


def test_scorer_gives_the_full_logits_logprobs_at_generated_tokens(rollouts) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, trees = rollouts
    batch = collate_paths(tree_paths(trees, "grpo"), tokenizer.pad_token_id)
    with torch.no_grad():
        full = token_logprobs(model, batch.ids, batch.attention)[batch.mask]
        chunked = TokenScorer(model, chunk=5)(batch.ids, batch.attention, batch.mask)
    torch.testing.assert_close(chunked, full, atol=1e-6, rtol=1e-6)


def test_a_micro_batched_update_matches_the_one_pass_update(rollouts) -> None:  # type: ignore[no-untyped-def]
    """A whole update (clip, AdamW step) with micro-batches lands on the one-pass weights."""
    model, tokenizer, trees = rollouts
    state = {k: v.clone() for k, v in model.state_dict().items()}
    after = []
    try:
        for micro in (0, 80):
            model.load_state_dict(state)
            config = UpdateConfig(lr=1e-3, minibatch=16, micro_tokens=micro)
            stats = update_policy(
                model, make_optimizer(model, config), trees, config, np.random.default_rng(0),
                tokenizer.pad_token_id,
            )  # fmt: skip
            after.append(({k: v.clone() for k, v in model.state_dict().items()}, stats))
    finally:
        model.load_state_dict(state)
    (one, one_stats), (many, many_stats) = after
    assert many_stats.passes > one_stats.passes == one_stats.steps
    assert many_stats.steps == one_stats.steps and many_stats.tokens == one_stats.tokens
    for name, value in one.items():
        torch.testing.assert_close(many[name], value, atol=1e-5, rtol=1e-5, msg=name)
    assert many_stats.logprob_gap == pytest.approx(one_stats.logprob_gap, abs=1e-6)
