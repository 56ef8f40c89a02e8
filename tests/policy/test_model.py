"""The tiny policy, its checkpoints, and the functional decoder forward (Qwen3, Llama with
default and Llama 3 RoPE) against HF's."""

from __future__ import annotations

import copy

import pytest
import torch
from support.models import tiny_llama

from trace_core.policy import decode, decoder
from trace_core.policy.model import (
    TinyPolicyConfig,
    create_policy,
    load_checkpoint,
    save_checkpoint,
)
from trace_core.policy.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["the quick brown fox jumps over the lazy dog", "12 + 30 = 42"])


ARCHS = ["qwen3", "llama", "llama3-rope"]


def sharpened(kv_heads: int = 2, seed: int = 0, arch: str = "qwen3"):
    """A tiny policy with weights scaled up: HF's 0.02-std init gives near-uniform logits,
    which would let rounding noise hide in the comparisons."""
    if arch == "qwen3":
        model = create_policy(TOK, TinyPolicyConfig(num_kv_heads=kv_heads), seed=seed)
    else:
        model = tiny_llama(len(TOK), kv_heads, seed, llama3_rope=arch == "llama3-rope")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    return model


def float64(model):
    """A float64 copy of HF's model: the reference the float32 decoder is held to.

    On sharpened weights a float32 forward is ill-conditioned at a few positions: there HF's
    float32 forward and ours both land up to ~6e-6 × the largest logit from float64 (~1e-4),
    by an amount that depends on the CPU's kernels. Against float64, with a tolerance of 1e-5
    × the largest logit, the test holds on any CPU and still fails on a wrong RoPE or mask
    (errors of order 1)."""
    return copy.deepcopy(model).double()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TinyPolicyConfig(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim must be even"):
        TinyPolicyConfig(head_dim=63)


def test_create_policy_is_seeded_and_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = create_policy(TOK, TinyPolicyConfig(), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = create_policy(TOK, TinyPolicyConfig(), seed=7)
    c = create_policy(TOK, TinyPolicyConfig(), seed=8)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.vocab_size == len(TOK) and a.config.tie_word_embeddings
    assert a.lm_head.weight.data_ptr() == wa.data_ptr()  # tied
    # 128·V embedding + per layer (q, k, v, o: 4·128² ; MLP: 3·128·256 ; norms: 2·128 + 2·64)
    per_layer = 4 * 128 * 128 + 3 * 128 * 256 + 2 * 128 + 2 * 64
    assert sum(p.numel() for p in a.parameters()) == 128 * len(TOK) + 2 * per_layer + 128


def test_checkpoint_round_trip(tmp_path) -> None:
    model = sharpened()
    save_checkpoint(model, TOK, tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    loaded, tok = load_checkpoint(tmp_path)
    ids = torch.tensor([TOK.encode("the lazy fox = 42", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert tok.get_vocab() == TOK.get_vocab()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


# -- decoder.forward against HF ---------------------------------------------------------------


def run_rows(weights: decoder.DecoderWeights, rows: list[torch.Tensor], split: int | None) -> list:
    """Ragged rows through decoder.forward: in one pass, or ``split`` tokens then one at a time."""
    width = max(len(r) for r in rows)
    cache = decoder.KVCache.zeros(weights, len(rows), width)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    positions = torch.arange(width).expand(len(rows), width)
    steps = (
        [(0, width)] if split is None else [(0, split)] + [(t, t + 1) for t in range(split, width)]
    )
    chunks = [
        decoder.lm_logits(
            weights, decoder.forward(weights, tokens[:, a:b], positions[:, a:b], cache)
        )
        for a, b in steps
    ]
    logits = torch.cat(chunks, dim=1)  # (B, width, V)
    return [logits[i, : len(r)] for i, r in enumerate(rows)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_heads", [2, 1])  # plain and grouped-query attention
@pytest.mark.parametrize("split", [None, 3])  # one pass; 3-token prefill, then a KV-cached decode
def test_forward_matches_hf(kv_heads: int, split: int | None, arch: str) -> None:
    model = sharpened(kv_heads, arch=arch)
    weights = decoder.DecoderWeights.from_model(model)
    reference = float64(model)
    gen = torch.Generator().manual_seed(kv_heads)
    rows = [torch.randint(0, len(TOK), (n,), generator=gen) for n in (9, 4, 12)]
    with torch.inference_mode():
        ours = run_rows(weights, rows, split)
        for row, got in zip(rows, ours, strict=True):
            want = reference(row[None]).logits[0].float()  # each row alone, no padding
            scale = float(want.abs().max())
            assert scale > 1  # sharpened: the comparison is not of near-zeros
            torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-4)


def test_forward_matches_hf_left_padded_batch() -> None:
    """HF's own batching (left padding + attention mask + positions) gives the same logits."""
    model = sharpened()
    weights = decoder.DecoderWeights.from_model(model)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, len(TOK), (n,), generator=gen) for n in (5, 11, 8)]
    width = 11
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        hf = float64(model)(ids, attention_mask=mask, position_ids=positions).logits.float()
        ours = run_rows(weights, rows, split=None)
    for i, r in enumerate(rows):
        torch.testing.assert_close(ours[i], hf[i, width - len(r) :], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_decode_step_matches_forward(kv_heads: int, arch: str) -> None:
    """decode_step, the engine's hot loop (one token per row at each row's own position, the
    additive mask kept across steps), gives the hidden states of one forward pass over the
    whole sequences."""
    model = sharpened(kv_heads, arch=arch)
    weights = decoder.DecoderWeights.from_model(model)
    s = weights.spec
    gen = torch.Generator().manual_seed(5)
    lens, steps = [5, 2, 7], 4  # ragged prompts, then 4 decoded tokens per row
    B, P = len(lens), max(lens)
    seqs = torch.randint(0, len(TOK), (B, P + steps), generator=gen)
    for b, n in enumerate(lens):  # row b: prompt seqs[b, :n], then its decoded tokens
        seqs[b, n : n + steps] = torch.randint(0, len(TOK), (steps,), generator=gen)
    positions = torch.arange(P + steps).expand(B, -1)
    with torch.inference_mode():
        whole = decoder.forward(
            weights, seqs, positions, decoder.KVCache.zeros(weights, B, P + steps)
        )  # (B, P + steps, C)

        cache = decoder.KVCache.zeros(weights, B, P + steps)
        decoder.forward(weights, seqs[:, :P], positions[:, :P], cache)  # prefill (padded rows)
        at = torch.tensor(lens)
        cols = torch.arange(P + steps)
        mask = torch.zeros((B, P + steps)).masked_fill_(cols >= at[:, None], float("-inf"))
        mask = mask.repeat_interleave(s.num_kv_heads, dim=0).unsqueeze(1)  # (B·Hkv, 1, T)
        dest = decoder.kv_rows(at, B, s.num_kv_heads, P + steps).flatten()
        views = decode.DecodeViews.of(cache)
        for t in range(steps):
            tokens = seqs[torch.arange(B), at]
            rope = weights.rope[at]
            got = decode.decode_step(weights, tokens, dest, rope, views, mask, P + t + 1)
            want = whole[torch.arange(B), at]  # (B, C)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            at += 1
            dest += 1


def test_untied_head_and_state_dict_loading() -> None:
    model = sharpened()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    model.config.tie_word_embeddings = False
    weights = decoder.DecoderWeights.from_state_dict(state, model.config)
    assert not torch.equal(weights.lm_head, weights.embed.T)
    hidden = torch.randn(2, 128)
    torch.testing.assert_close(
        decoder.lm_logits(weights, hidden), hidden @ state["lm_head.weight"].T
    )


def test_unsupported_configs_are_refused() -> None:
    model = create_policy(TOK, TinyPolicyConfig(), seed=0)
    model.config.use_sliding_window = True
    with pytest.raises(NotImplementedError, match="sliding"):
        decoder.DecoderWeights.from_model(model)
    model = create_policy(TOK, TinyPolicyConfig(), seed=0)
    model.config.model_type = "qwen2"
    with pytest.raises(NotImplementedError, match=r"model_type 'qwen2'.*--engine hf"):
        decoder.DecoderSpec.from_config(model.config)
    llama = tiny_llama(len(TOK), 2, 0)
    llama.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(NotImplementedError, match="default and llama3 RoPE"):
        decoder.DecoderSpec.from_config(llama.config)
    llama.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    llama.config.mlp_bias = True
    with pytest.raises(NotImplementedError, match="MLP biases"):
        decoder.DecoderSpec.from_config(llama.config)
