"""TorchEngine's compiled decode step (``policy.native``, ``decode_step.cpp``): built by
``make setup``, equal to the Python step bit for bit (hidden states, and what it writes to the
KV cache and the mask), and the engine's fallback to Python where it cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import tiny_llama

from trace_core.policy import decode, decoder, native
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.tokenizer import build_word_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_make_setup_built_the_step_for_this_torch() -> None:
    """The suite runs the compiled step (``make setup`` builds it): the recorded-token tests of
    test_torch_engine.py and test_replicas.py check its tokens."""
    assert native.decode_step() is not None, native.reason()
    assert native.built() is not None


def policy(arch: str, kv_heads: int) -> torch.nn.Module:
    """The tiny policy (Qwen3: q/k norms), or its dimensions as Llama (none)."""
    tokenizer = build_word_tokenizer(["the quick brown fox jumps over the lazy dog"])
    if arch == "qwen3":
        return create_policy(tokenizer, TinyPolicyConfig(num_kv_heads=kv_heads), seed=0)
    return tiny_llama(len(tokenizer), kv_heads, seed=0)


def one_step(weights, rows: int, span: int, step) -> tuple[torch.Tensor, ...]:
    """A decode step at ``span`` over a cache of random keys and values, by ``step`` (the
    compiled op's wrapper or the Python step): hidden states, then the cache and mask after."""
    s = weights.spec
    gen = torch.Generator().manual_seed(rows * 100 + span)
    length = span + 3
    cache = decoder.KVCache.zeros(weights, rows, length)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(weights.dtype))
    at = torch.randint(0, span, (rows,), generator=gen)
    at[0] = span - 1
    cols = torch.arange(length)
    mask = torch.zeros((rows, length), dtype=weights.dtype)
    mask = mask.masked_fill_(cols >= at[:, None], float("-inf"))
    mask = mask.repeat_interleave(s.num_kv_heads, dim=0).unsqueeze(1)
    dest = decoder.kv_rows(at, rows, s.num_kv_heads, length).flatten()
    tokens = torch.randint(0, s.vocab_size, (rows,), generator=gen)
    views = decode.DecodeViews.of(cache)
    with torch.inference_mode():
        hidden = step(weights, tokens, dest, weights.rope[at], views, mask, span)
    return hidden, cache.kv, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("arch", "kv_heads"), [("qwen3", 2), ("qwen3", 1), ("llama", 1)])
def test_the_compiled_step_is_the_python_step_bit_for_bit(
    arch: str, kv_heads: int, dtype: torch.dtype
) -> None:
    assert native.decode_step() is not None, native.reason()
    weights = decoder.DecoderWeights.from_model(policy(arch, kv_heads), dtype=dtype)
    for rows, span in [(1, 1), (3, 9), (32, 64)]:
        compiled = one_step(weights, rows, span, decode.decode_step)
        python = one_step(weights, rows, span, decode._decode_step_python)
        for got, want in zip(compiled, python, strict=True):
            assert got.dtype == want.dtype
            assert torch.equal(got, want), (arch, kv_heads, dtype, rows, span)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0), (1.3, 0.5)])
def test_the_compiled_draw_is_the_python_draw_bit_for_bit(temperature: float, top_p: float) -> None:
    """The head, the keyed draw and the writes to the output columns (rows past the last
    column write to it), at every sampling setting the running batch passes."""
    assert native.sample_step() is not None, native.reason()
    weights = decoder.DecoderWeights.from_model(policy("qwen3", 2))
    gen = torch.Generator().manual_seed(int(temperature * 10 + top_p * 100))
    rows, width = 24, 6
    hidden = torch.randn((rows, weights.spec.hidden_size), generator=gen) * 3
    table = torch.rand((rows, width), generator=gen, dtype=torch.float64)
    steps = torch.randint(0, width + 3, (rows,), generator=gen)
    results = []
    for step in (decode.sample_step, decode._sample_step_python):
        state = [
            steps.clone(),
            torch.zeros((rows, width), dtype=torch.long),
            torch.zeros(rows, width),
        ]
        with torch.inference_mode():
            tokens = step(weights, hidden, decode.Draws(table, *state, temperature, top_p))
        results.append([tokens, *state])
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), (temperature, top_p)
    assert torch.equal(results[0][1], steps + 1)


def test_the_library_name_changes_with_the_source(tmp_path: Path, monkeypatch) -> None:
    before = native.library_name()
    changed = tmp_path / "decode_step.cpp"
    changed.write_text(native.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    assert native.library_name() != before
    assert native.library_name().startswith("trace_native-")


PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from trace_core.bench.engine import bench_policy
from trace_core.policy import native
from trace_core.policy.engine import SamplingParams
from trace_core.policy.torch_engine import TorchEngine
model, _, random_tokens = bench_policy(seed=0)
prompts = [random_tokens(8) for _ in range(4)]
out = TorchEngine(model).generate(prompts, SamplingParams(n=1, max_tokens=6), seed=1)
print(json.dumps({"native": native.decode_step() is not None, "reason": native.reason(),
                  "tokens": [c.token_ids.tolist() for cs in out for c in cs]}))
"""


def probe(env: dict[str, str]) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_without_the_compiled_step_the_engine_decodes_the_same_tokens_in_python(
    tmp_path: Path,
) -> None:
    """Switched off, or with no compiler and nothing built: the same tokens, and the reason
    logged once with the command that builds the step."""
    compiled, _ = probe({})
    assert compiled["native"] is True
    switched_off, log = probe({native.DISABLE: "0"})
    assert switched_off == {**compiled, "native": False, "reason": "TRACE_NATIVE=0"}
    assert log.count("TorchEngine decodes in Python (TRACE_NATIVE=0)") == 1
    assert "`python -m trace_core.policy.native` builds its compiled step" in log
    empty = tmp_path / "native"
    missing = str(tmp_path / "no-such-c++")
    no_compiler, log = probe({native.DIRECTORY: str(empty), "CXX": missing})
    assert no_compiler["native"] is False and no_compiler["tokens"] == compiled["tokens"]
    assert no_compiler["reason"].startswith(f"{missing} did not run"), no_compiler["reason"]
    assert not list(empty.glob("*.so")), "nothing half-built is left behind"


def test_the_build_command_as_printed_finds_what_make_setup_built() -> None:
    """`python -m trace_core.policy.native` (make setup's command, and the one the fallback's
    warning names): it prints the library and loads it, without building it again. (Building
    is make setup's, and tests/images/test_image_context.py runs the CPU image's build.)"""
    done = subprocess.run(
        [sys.executable, "-m", "trace_core.policy.native"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"TorchEngine's compiled decode step: {native.built()}\n"
    assert "building" not in done.stderr
