"""fp32 master weights: a policy stored in bfloat16 trains in float32 and is written back in
bfloat16 for the engines, its fp32 weights kept beside the optimizer state; tokenizers without
a pad token train; gradient checkpointing keeps fewer activations."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerFast

from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import (
    MASTER,
    TinyPolicyConfig,
    checkpoint_dtype,
    create_policy,
    load_checkpoint,
    load_for_training,
    load_master,
    save_checkpoint,
    save_master,
)
from trace_core.policy.tokenizer import build_word_tokenizer, padding_id
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import (
    TokenScorer,
    UpdateConfig,
    checkpoint_layers,
    make_optimizer,
    tree_paths,
    update_policy,
)
from trace_core.rollout.flat import rollout_flat

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
LR = 1e-6
"""AdamW's first step moves each element by ≈ lr; bf16 keeps 8 bits of mantissa, so next to a
weight of 0.02 (a step of 1.2e-4) such a move rounds away."""


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bf16_policy(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny policy stored in bfloat16 (as Qwen3 and Llama checkpoints are), and trees with
    mixed rewards sampled from it."""
    suite = CalcSuite(seed=1, train_size=24, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    folder = tmp_path_factory.mktemp("bf16") / "policy"
    save_checkpoint(create_policy(tokenizer, SMALL, seed=0).to(torch.bfloat16), tokenizer, folder)
    engine_model, _ = load_checkpoint(folder, dtype=torch.float32)
    trees = rollout_flat(
        TorchEngine(engine_model),
        TurnFormat(tokenizer),
        suite.make_env,
        suite.tasks("train")[:8],
        SamplingParams(n=4, max_tokens=10),
        seed=0,
    )
    for tree in trees:  # an untrained policy never answers right: two leaves of each succeed
        for leaf in np.flatnonzero(tree.leaf_mask)[:2]:
            tree.reward[leaf] = 1.0
    return folder, trees


def one_update(model: torch.nn.Module, trees, pad_id: int, serving: torch.dtype) -> object:  # type: ignore[no-untyped-def]
    config = UpdateConfig(lr=LR, minibatch=1000)  # one step on every path
    return update_policy(
        model,
        make_optimizer(model, config),  # type: ignore[arg-type]
        trees,
        config,
        np.random.default_rng(0),
        pad_id,
        serving=serving,
    )


def test_a_bf16_checkpoint_trains_in_fp32_and_moves_as_fp32_arithmetic_says(
    bf16_policy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    folder, trees = bf16_policy
    assert checkpoint_dtype(folder) == torch.bfloat16
    master, tokenizer, serving = load_for_training(folder)
    assert serving == torch.bfloat16
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in master.named_parameters()}
    stats = one_update(master, trees, padding_id(tokenizer), serving)
    assert (stats.master_dtype, stats.compute_dtype) == ("float32", "float32")  # type: ignore[attr-defined]
    assert stats.old_recomputed  # type: ignore[attr-defined]  # the engines served bf16 weights

    # The same update in float64 arithmetic, from the same weights: what the step should be.
    exact, _ = load_checkpoint(folder, dtype=torch.float64)
    one_update(exact, trees, padding_id(tokenizer), serving)
    moved = exact_moved = total = 0
    for name, p in master.named_parameters():
        want = exact.get_parameter(name).detach()
        # Equal up to fp32's rounding of the result (2 ulps) and 2% of a step.
        assert torch.allclose(p.detach().double(), want, rtol=2.4e-7, atol=LR * 0.02), name
        moved += int((p.detach() != before[name]).sum())
        exact_moved += int((want != before[name].double()).sum())
        total += p.numel()
    assert moved == exact_moved and moved > 0.9 * total  # nearly every weight took its step

    # Trained as its checkpoint is stored, in pure bf16, nearly every step rounds away.
    rounded, _ = load_checkpoint(folder)
    assert next(rounded.parameters()).dtype == torch.bfloat16
    one_update(rounded, trees, padding_id(tokenizer), serving)
    kept = sum(int((p.detach().float() != before[n]).sum()) for n, p in rounded.named_parameters())
    assert kept < 0.1 * total

    # For the engines, the update is written back in bf16; the fp32 weights go beside.
    out = tmp_path / "policy"
    save_checkpoint(master, tokenizer, out, dtype=serving)
    save_master(master, tmp_path, serving)
    assert checkpoint_dtype(out) == torch.bfloat16
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    served, _ = load_checkpoint(out)
    for name, p in served.named_parameters():
        assert torch.equal(p, master.get_parameter(name).detach().to(torch.bfloat16)), name
    resumed, _, _ = load_for_training(out)
    assert load_master(resumed, tmp_path)
    for name, p in resumed.named_parameters():
        assert torch.equal(p, master.get_parameter(name)), name  # exact, not bf16-rounded


def test_a_float32_policy_writes_no_master_file(tmp_path: Path) -> None:
    tokenizer = build_word_tokenizer(["1 + 2"])
    model = create_policy(tokenizer, SMALL, seed=0)
    save_master(model, tmp_path, torch.float32)
    assert not (tmp_path / MASTER).exists()
    assert not load_master(model, tmp_path)


def test_master_weights_of_another_policy_are_refused(tmp_path: Path) -> None:
    tokenizer = build_word_tokenizer(["1 + 2"])
    save_master(create_policy(tokenizer, SMALL, seed=0), tmp_path, torch.bfloat16)
    other = create_policy(tokenizer, TinyPolicyConfig(hidden_size=64, num_layers=1), seed=0)
    with pytest.raises(ValueError, match=MASTER):
        load_master(other, tmp_path)


def test_an_unknown_checkpoint_dtype_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "dtype": "float8_e4m3fn"}')
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        checkpoint_dtype(tmp_path)


def test_a_tokenizer_without_a_pad_token_trains_and_rolls_out(bf16_policy) -> None:  # type: ignore[no-untyped-def]
    """The Llama 3 family ships no pad token: batches pad with EOS, masked out as any pad."""
    folder, _ = bf16_policy
    model, tokenizer, serving = load_for_training(folder)
    bare = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token,
        clean_up_tokenization_spaces=False,
    )
    bare.chat_template = tokenizer.chat_template
    assert bare.pad_token_id is None
    assert padding_id(bare) == bare.eos_token_id
    suite = CalcSuite(seed=2, train_size=8, eval_size=2)
    trees = rollout_flat(
        TorchEngine(model),
        TurnFormat(bare),
        suite.make_env,
        suite.tasks("train")[:4],
        SamplingParams(n=4, max_tokens=8),
        seed=1,
    )
    for tree in trees:
        tree.reward[np.flatnonzero(tree.leaf_mask)[:1]] = 1.0
    stats = one_update(model, trees, padding_id(bare), serving)
    assert stats.paths > 0 and np.isfinite(stats.loss)  # type: ignore[attr-defined]


def test_checkpointing_keeps_fewer_activations_for_the_same_loss(bf16_policy) -> None:  # type: ignore[no-untyped-def]
    folder, trees = bf16_policy
    model, tokenizer, _ = load_for_training(folder)
    model.train()
    paths = tree_paths(trees, "grpo")[:8]
    from trace_core.policy.update import collate_paths

    batch = collate_paths(paths, padding_id(tokenizer))
    scorer = TokenScorer(model)

    def saved_elements() -> tuple[int, torch.Tensor]:
        count = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = scorer(batch.ids, batch.attention, batch.mask).sum()
        return count, out.detach()

    plain, loss = saved_elements()
    undo = checkpoint_layers(model)
    kept, same = saved_elements()
    undo()
    again, _ = saved_elements()
    assert torch.equal(loss, same)
    assert kept < plain / 2  # each layer keeps its input only, not its intermediates
    assert again == plain  # undone
