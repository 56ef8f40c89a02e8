"""TorchEngine against HF generate and the model's own distribution; the prefix cache's counts.

HF ``generate`` and an HF forward pass are the oracles: greedy decoding must agree token for
token, and logprobs must be the model's log-softmax at the sampled tokens. The prefix-cache
tests count the tokens that were actually prefilled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.hf_engine import HFGenerateEngine
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.prefix_cache import PrefixCache
from trace_core.policy.sampling import request_seed
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine

TOK = build_word_tokenizer(["the quick brown fox jumps over the lazy dog", "12 + 30 = 42"])
V = len(TOK)


def sharpened(seed: int = 0, kv_heads: int = 2):
    """Random tiny policy with weights scaled so its next-token distributions are peaked
    (HF's init gives near-uniform logits, where greedy ties would depend on rounding)."""
    model = create_policy(TOK, TinyPolicyConfig(num_kv_heads=kv_heads), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    return model


MODEL = sharpened()


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, V, (n,), generator=gen).tolist() for n in lengths]


def hf_logprobs(model, prompt: list[int], completion: np.ndarray) -> np.ndarray:
    """log p(completion[t] | prompt, completion[:t]) from one HF forward pass."""
    ids = torch.tensor([prompt + completion.tolist()])
    with torch.no_grad():
        logp = model(ids).logits[0].log_softmax(-1)  # (T, V)
    at = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logp[at, ids[0, at + 1]].numpy()


# -- agreement with HF ----------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.slow
def test_greedy_matches_hf_generate_for_ragged_prompts(kv_heads: int) -> None:
    model = MODEL if kv_heads == 2 else sharpened(kv_heads=1)
    prompts = prompts_of([3, 9, 1, 6, 14])
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    ours = TorchEngine(model).generate(prompts, params, seed=0)
    theirs = HFGenerateEngine(model).generate(prompts, params, seed=0)
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        assert len(a) == len(b) == 2
        for x, y in zip(a, b, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            assert len(x.token_ids) == 12 and not x.finished  # max_tokens respected
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            np.testing.assert_allclose(
                x.logprobs, hf_logprobs(model, prompt, x.token_ids), atol=1e-4
            )


def test_stop_tokens_end_rows_at_different_steps() -> None:
    """Many stop ids: rows finish at different steps, so the batch shrinks along the way."""
    prompts = prompts_of([4, 7, 2, 9, 5, 3, 8, 6], seed=1)
    free = TorchEngine(MODEL).generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    # Stop on every token some row emits at step 2 or 5: each row then ends by step 6.
    stops = tuple(sorted({int(c[0].token_ids[t]) for c in free for t in (2, 5)}))
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stops)
    ours = TorchEngine(MODEL).generate(prompts, params)
    theirs = HFGenerateEngine(MODEL).generate(prompts, params)
    lengths = set()
    for a, b in zip(ours, theirs, strict=True):
        x, y = a[0], b[0]
        assert x.token_ids.tolist() == y.token_ids.tolist()
        assert x.finished and y.finished
        assert x.token_ids[-1] in stops  # the stop token is kept ...
        assert not set(x.token_ids[:-1].tolist()) & set(stops)  # ... and is the first one
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
        lengths.add(len(x.token_ids))
    assert len(lengths) > 1 and max(lengths) <= 6


def test_sampled_logprobs_are_the_models_at_temperature_one() -> None:
    prompts = prompts_of([5, 10])
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_tokens=10)
    out = TorchEngine(MODEL).generate(prompts, params, seed=3)
    for prompt, comps in zip(prompts, out, strict=True):
        for c in comps:
            np.testing.assert_allclose(
                c.logprobs, hf_logprobs(MODEL, prompt, c.token_ids), atol=1e-4
            )


# -- sampling -------------------------------------------------------------------------------


@pytest.mark.slow
def test_seeded_sampling_is_reproducible() -> None:
    prompts = prompts_of([4, 8])
    params = SamplingParams(n=4, max_tokens=10)

    def run(seed: int) -> list[list[int]]:
        out = TorchEngine(MODEL).generate(prompts, params, seed=seed)
        return [c.token_ids.tolist() for comps in out for c in comps]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_a_prompts_samples_do_not_depend_on_the_rest_of_the_call() -> None:
    """Each prompt samples from its own seed's keys: alone, among others in any order, or
    split over decode batches, it gets the same tokens."""
    prompts = prompts_of([4, 8, 6, 5])
    params = SamplingParams(n=3, max_tokens=10)
    seeds = [request_seed(9, i) for i in range(4)]

    def tokens(out: list[list[Completion]]) -> list[list[list[int]]]:
        return [[c.token_ids.tolist() for c in comps] for comps in out]

    together = tokens(TorchEngine(MODEL).generate(prompts, params, seed=seeds))
    alone = [tokens(TorchEngine(MODEL).generate([p], params, seed=[s]))[0] for p, s in
             zip(prompts, seeds, strict=True)]  # fmt: skip
    reversed_ = tokens(TorchEngine(MODEL).generate(prompts[::-1], params, seed=seeds[::-1]))
    narrow = tokens(TorchEngine(MODEL, max_batch=2).generate(prompts, params, seed=seeds))
    assert together == alone == reversed_[::-1] == narrow
    assert together == tokens(TorchEngine(MODEL).generate(prompts, params, seed=9))  # one int
    assert len({tuple(t) for comps in together for t in comps}) > 6  # samples differ


def next_token_probs(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].softmax(-1).numpy()


@pytest.mark.slow
def test_temperature_one_samples_follow_the_model() -> None:
    prompt = prompts_of([6], seed=4)[0]
    p = next_token_probs(MODEL, prompt)
    n = 4000
    out = TorchEngine(MODEL).generate([prompt], SamplingParams(n=n, max_tokens=1), seed=0)
    freq = np.bincount([int(c.token_ids[0]) for c in out[0]], minlength=V) / n
    # Binomial standard error per token; 5 sigma plus a floor for the rarest tokens.
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 2e-3)
    assert 0.5 * np.abs(freq - p).sum() < 0.05  # total variation


def test_top_p_excludes_the_unlikely_tokens() -> None:
    model = create_policy(TOK, TinyPolicyConfig(), seed=1)  # HF init: a flat distribution
    prompt = prompts_of([6], seed=4)[0]
    p = next_token_probs(model, prompt)
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    allowed = set(order[before < 0.3].tolist())  # the smallest top set with mass >= 0.3
    assert 3 < len(allowed) < V // 2
    out = TorchEngine(model).generate([prompt], SamplingParams(n=500, top_p=0.3, max_tokens=1))
    seen = {int(c.token_ids[0]) for c in out[0]}
    assert seen <= allowed and len(seen) > 3


# -- prefix reuse ---------------------------------------------------------------------------


def test_samples_share_their_prompts_prefill() -> None:
    prompts = [[4, 5, 6, 7], [8, 9], [10, 11, 12]]  # no shared prefix
    engine = TorchEngine(MODEL)
    engine.generate(prompts, SamplingParams(n=5, max_tokens=4), seed=0)
    assert engine.stats.prompt_tokens == 9
    assert engine.stats.prefill_tokens == 9  # not 5 × 9
    assert engine.stats.generated_tokens == 3 * 5 * 4


@pytest.mark.slow
def test_prompts_sharing_an_uncached_prefix_prefill_it_once() -> None:
    # Trie of the prompts: 4 5 6 7 8 | 4 5 6 9 | 4 5 6 7 8 (again): 5 + 1 distinct tokens.
    engine = TorchEngine(MODEL)
    out = engine.generate(
        [[4, 5, 6, 7, 8], [4, 5, 6, 9], [4, 5, 6, 7, 8]], SamplingParams(temperature=0)
    )
    assert engine.stats.prefill_tokens == 6
    assert out[0][0].token_ids.tolist() == out[2][0].token_ids.tolist()
    reference = HFGenerateEngine(MODEL).generate([[4, 5, 6, 9]], SamplingParams(temperature=0))
    assert out[1][0].token_ids.tolist() == reference[0][0].token_ids.tolist()


@pytest.mark.slow
def test_next_turn_prefills_only_the_observation() -> None:
    engine = TorchEngine(MODEL)
    prompt = prompts_of([10])[0]
    params = SamplingParams(n=2, max_tokens=6, temperature=0.8)
    first = engine.generate([prompt], params, seed=0)[0]
    assert engine.stats.prefill_tokens == 10
    obs = [[4, 5, 6], [7, 8, 9, 10]]
    turn2 = [prompt + c.token_ids.tolist() + o for c, o in zip(first, obs, strict=True)]
    second = engine.generate(turn2, params, seed=1)
    assert engine.stats.prefill_tokens == 10 + 3 + 4  # prompt and sampled turns came cached
    # Continuing from the middle of a sampled turn (a TRACE branch point): all cached, so
    # only the last token is rerun (for its logits).
    mid = prompt + first[0].token_ids[:3].tolist()
    engine.generate([mid], params, seed=2)
    assert engine.stats.prefill_tokens == 17 + 1
    # Cached KV gives the same answers as a fresh engine would.
    fresh = TorchEngine(MODEL).generate(turn2, params, seed=1)
    for a, b in zip(second, fresh, strict=True):
        assert a[0].token_ids.tolist() == b[0].token_ids.tolist()
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-5)


@pytest.mark.slow
def test_a_small_cache_evicts_and_stays_correct() -> None:
    engine = TorchEngine(MODEL, cache_tokens=48)
    reference = HFGenerateEngine(MODEL)
    params = SamplingParams(temperature=0, max_tokens=8)
    for seed in range(4):
        prompts = prompts_of([6, 9], seed=seed)
        got = engine.generate(prompts, params)
        want = reference.generate(prompts, params)
        for a, b in zip(got, want, strict=True):
            assert a[0].token_ids.tolist() == b[0].token_ids.tolist()
    assert engine.stats.extra["evicted_tokens"] > 0
    check_cache(engine.cache)
    # Two 30-token prompts cannot sit in a 48-token pool together: the call is split in two
    together = prompts_of([30, 30])
    for a, b in zip(
        engine.generate(together, params), reference.generate(together, params), strict=True
    ):
        assert a[0].token_ids.tolist() == b[0].token_ids.tolist()
    check_cache(engine.cache)
    with pytest.raises(RuntimeError, match="cache_tokens"):  # one prompt larger than the pool
        engine.generate(prompts_of([60]), params)
    check_cache(engine.cache)  # the failed call left nothing locked or half-built behind
    assert engine.generate(prompts_of([6]), params)[0][0].token_ids.size == 8


def check_cache(cache: PrefixCache) -> None:
    """Between calls: no locks held, nothing pending, every slot owned by exactly one node."""
    owned: list[int] = []
    stack = [cache.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.tokens[0] == first and child.refs == 0
            assert child.slots is not None and len(child.slots) == len(child.tokens)
            owned += child.slots.tolist()
            stack.append(child)
    assert len(owned) == len(set(owned)) == cache.used <= cache.capacity


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(st.data())
def test_random_call_sequences_agree_with_hf(data: st.DataObject) -> None:
    """Calls that extend, cut and repeat earlier sequences, through a cache small enough to
    evict, give HF's greedy tokens and logprobs every time."""
    engine = TorchEngine(MODEL, cache_tokens=data.draw(st.sampled_from([100, 160, 4096])))
    oracle = HFGenerateEngine(MODEL)
    tokens = st.integers(4, V - 1)
    history: list[list[int]] = []
    for _ in range(3):
        prompts = []
        for _ in range(data.draw(st.integers(1, 3))):
            kind = data.draw(st.sampled_from(["new", "extend", "cut"])) if history else "new"
            if kind == "new":
                prompts.append(data.draw(st.lists(tokens, min_size=1, max_size=8)))
                continue
            base = data.draw(st.sampled_from(history))
            if kind == "extend":  # the next turn: history + observation
                prompts.append(base + data.draw(st.lists(tokens, min_size=1, max_size=3)))
            else:  # a branch from an intermediate prefix
                prompts.append(base[: data.draw(st.integers(1, len(base)))])
        params = SamplingParams(
            n=data.draw(st.integers(1, 2)),
            temperature=0,
            max_tokens=data.draw(st.integers(1, 5)),
            stop_token_ids=tuple(data.draw(st.sets(tokens, max_size=6))),
        )
        got, want = engine.generate(prompts, params), oracle.generate(prompts, params)
        for prompt, a, b in zip(prompts, got, want, strict=True):
            for x, y in zip(a, b, strict=True):
                assert x.token_ids.tolist() == y.token_ids.tolist()
                assert x.finished == y.finished
                np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
                history.append(prompt + x.token_ids.tolist())
        check_cache(engine.cache)
    assert engine.stats.prefill_tokens <= oracle.stats.prefill_tokens


def test_small_batches_and_prefill_passes_do_not_change_results() -> None:
    prompts = prompts_of([3, 8, 5, 12])
    params = SamplingParams(n=3, temperature=0, max_tokens=5)
    small = TorchEngine(MODEL, max_batch=2, prefill_chunk=16).generate(prompts, params)
    large = TorchEngine(MODEL).generate(prompts, params)
    assert [[c.token_ids.tolist() for c in cs] for cs in small] == [
        [c.token_ids.tolist() for c in cs] for cs in large
    ]


def test_stale_kv_buffer_contents_are_never_read() -> None:
    """The prefill and decode buffers are reused across calls without zeroing: whatever finite
    values are left in them must not change the next call's tokens or logprobs."""
    prompts = prompts_of([3, 9, 5])
    params = SamplingParams(n=2, temperature=0, max_tokens=6)
    engine = TorchEngine(MODEL)
    engine.generate(prompts_of([20, 20, 20, 20], seed=1), params)  # grows the buffer
    engine.cache.clear()
    with torch.inference_mode():  # the engine made its buffers there
        engine._scratch.normal_(0, 100)  # large stale values in every column
    got = engine.generate(prompts, params)
    want = TorchEngine(MODEL).generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)


def test_bad_prompts_are_refused() -> None:
    engine = TorchEngine(MODEL)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[V]], SamplingParams())
    assert engine.generate([], SamplingParams()) == []


# -- a real pretrained model ---------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_generate_token_for_token() -> None:
    """SmolLM2-135M-Instruct (Llama architecture, no q/k norms, 49,152-token BPE): on chat
    prompts of the calc task, greedy TorchEngine and HF generate agree token for token, and
    the engine's logprobs are the model's."""
    from support.models import smollm2_dir

    from trace_core.envs.calc import CalcSuite
    from trace_core.policy.format import TurnFormat, TurnStyle
    from trace_core.policy.model import load_checkpoint

    model, tokenizer = load_checkpoint(smollm2_dir())
    suite = CalcSuite(train_size=0, eval_size=4)
    fmt = TurnFormat(tokenizer, TurnStyle(suite.instructions))
    prompts = [fmt.prompt_ids(task.prompt) for task in suite.tasks("eval")]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=fmt.stop_ids)
    engine = TorchEngine(model, cache_tokens=4096)
    ours = engine.generate(prompts, params, seed=0)
    theirs = HFGenerateEngine(model).generate(prompts, params, seed=0)
    assert engine.weights.layers[0].qk_norm is None  # Llama: no q/k norms
    for prompt, [a], [b] in zip(prompts, ours, theirs, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.finished == b.finished
        np.testing.assert_allclose(a.logprobs, hf_logprobs(model, prompt, a.token_ids), atol=1e-4)


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_tokens_are_the_recorded_ones(replicas: int) -> None:
    """The same prompts and seed sample the tokens TorchEngine sampled when they were
    recorded (tests/data/engine_tokens.json), in one process or on forked replicas
    (``policy.replicas``): speed work on the running batch changes no token."""
    import itertools
    import json
    import string

    from trace_core.policy.tokenizer import build_word_tokenizer

    recorded = json.loads((Path(__file__).parents[1] / "data" / "engine_tokens.json").read_text())
    words = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    model = create_policy(build_word_tokenizer([" ".join(words[:280])]), TinyPolicyConfig(), 0)
    engine = TorchEngine(model, replicas=replicas)
    settings = {
        "t1": SamplingParams(n=2, temperature=1.0, max_tokens=12),
        "t07p09": SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=12),
    }
    for name, params in settings.items():
        out = engine.generate(recorded["prompts"], params, seed=7)
        assert [[c.token_ids.tolist() for c in cs] for cs in out] == recorded["tokens"][name]
    engine.close()
