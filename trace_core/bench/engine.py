"""``trace-rl bench engine``: TorchEngine against HF ``generate``, and prefix reuse on a tree.

Two measurements on a tiny random-weight Qwen3 policy (≈330-token vocabulary; the weights do
not matter for speed), or on the model in ``checkpoint`` (say SmolLM2-135M from ``trace-rl
model import``; its prompts are random ids above its special tokens):

* **Throughput.** ``batch`` prompts of ``prompt_tokens`` random tokens, one sample each,
  ``new_tokens`` new tokens at temperature 1 with no stop token, so both engines produce
  exactly ``batch · new_tokens`` tokens. Each engine runs once to warm up, then the two take
  turns ``repeats`` times (paired: a repeat's two runs see the same load on the machine); the
  figures are medians, ``ratio_vs_hf`` the median of the repeats' ratios, with their lowest
  and highest (``ratio_vs_hf_min``, ``ratio_vs_hf_max``) as the spread. TorchEngine's prefix
  cache is cleared before every run, so it prefills the prompts as HF does and the ratio is
  decode against decode. On a CPU with more than one thread, TorchEngine decodes on one
  forked replica per thread (``policy.replicas``, as the rollout's engines do), and the same
  engine in one process takes its turn in every round too: ``ratio_vs_one_process`` (paired,
  with its spread) is what the replicas gain. With TorchEngine's compiled decode step
  (``policy.native``; ``compiled_step`` 1), the same engine (on its replicas) also takes a
  turn decoding in Python: ``ratio_vs_python_step`` (paired, with its spread) is what
  compiling the step gains.
* **Kernel floor.** The same run's unavoidable arithmetic alone: the prefill's and every
  decode step's matmuls and attention (scores, softmax, weighted values) at the same shapes on
  preallocated tensors, with nothing else (no norms, rope, sampling, KV writes or
  bookkeeping). ``floor_ratio_vs_hf`` is HF's time over that: what an engine built on these
  torch kernels could reach against HF at best, in this run on this machine; ``torch_vs_floor``
  is how far TorchEngine is from it.
* **vLLM** (when ``vllm_python`` names a Python with vLLM, e.g. ``.venv-vllm/bin/python``
  from ``make setup-vllm``): the same policy, saved as a checkpoint, and the same prompts and
  sampling, timed by ``trace_core.bench.vllm_timing`` in that Python (vLLM pins its own torch
  and transformers, so it cannot share this process). ``ratio_vs_vllm`` is vLLM's time over
  TorchEngine's. vLLM's CPU build runs its own threads, whatever ``threads`` says.
* **Tree workload.** The shape of a TRACE rollout: ``tree_prompts`` prompts sampled
  ``tree_samples`` times; every sample is extended with ``obs_tokens`` observation tokens and
  sampled again, for ``tree_turns`` turns; then every first turn is cut in half and sampled
  twice from there (branches from an intermediate prefix). ``unique_tokens`` counts the
  distinct (prefix-path) token positions in the resulting trees, prompts and generated tokens
  alike; ``prefill_tokens`` is what the engine ran through prefill, ``generated_tokens`` what
  it decoded; ``naive_prefill_tokens`` is what an engine without reuse (HF generate) would
  prefill. With perfect reuse, prefill + generated ≈ unique, plus one rerun token for each
  prompt that was entirely cached (a branch from an intermediate prefix).

    from trace_core.bench.engine import run_engine_bench
    print(run_engine_bench(batch=64, new_tokens=64, threads=1))

Timings are wall-clock and sensitive to other load on the machine: on a shared CPU, pass
``threads=1`` (oversubscribed OpenMP threads slow both engines by an order of magnitude).
"""

from __future__ import annotations

import itertools
import json
import string
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trace_core.bench.engine_profile import profile_generate
from trace_core.policy import native
from trace_core.policy.decoder import DecoderWeights
from trace_core.policy.engine import Completion, Engine, SamplingParams
from trace_core.policy.hf_engine import HFGenerateEngine
from trace_core.policy.model import (
    TinyPolicyConfig,
    create_policy,
    load_checkpoint,
    save_checkpoint,
)
from trace_core.policy.tokenizer import SPECIAL_TOKENS, build_word_tokenizer
from trace_core.policy.torch_engine import PASS_TOKENS, TorchEngine


def run_engine_bench(
    batch: int = 64,
    new_tokens: int = 64,
    prompt_tokens: int = 32,
    seed: int = 0,
    repeats: int = 5,
    threads: int | None = None,
    tree_prompts: int = 4,
    tree_samples: int = 4,
    tree_turns: int = 3,
    obs_tokens: int = 8,
    turn_tokens: int = 16,
    device: str = "cpu",
    vllm_python: Path | None = None,
    checkpoint: Path | None = None,
    profile: bool = False,
) -> dict[str, float]:
    """Throughput of the engines and the tree workload's prefill counts (see module doc);
    with ``profile``, where TorchEngine's decode steps spend their time on the throughput
    workload (``bench.engine_profile``), as ``profile_*`` entries."""
    if min(batch, new_tokens, prompt_tokens, repeats, tree_prompts, tree_samples) < 1:
        raise ValueError("batch, token counts, repeats and tree sizes must be >= 1")
    if tree_turns < 1 or obs_tokens < 1 or turn_tokens < 2:
        raise ValueError("tree_turns and obs_tokens must be >= 1 and turn_tokens >= 2")
    if vllm_python is not None and not vllm_python.is_file():
        raise FileNotFoundError(f"vllm_python: {vllm_python} is not a file (make setup-vllm?)")
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        model, tokenizer, random_tokens = bench_policy(seed, checkpoint)
        torch.nn.Module.to(model, torch.device(device))  # in place
        prompts = [random_tokens(prompt_tokens) for _ in range(batch)]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=new_tokens)
        # On a CPU, one replica per thread (``policy.replicas``), as an engine picks by itself;
        # with more than one, the same engine in one process (``here``) runs in the rounds too.
        rows = max(batch, 256)
        torch_engine = TorchEngine(model, device=device, max_batch=rows, replicas=0)
        here = torch_engine
        hf_engine = HFGenerateEngine(model)
        # Clearing the prefix cache makes TorchEngine prefill every run, as HF does.
        engines: list[tuple[Engine, Callable[[], None] | None]] = [
            (torch_engine, torch_engine.clear_cache),
            (hf_engine, None),
        ]
        if torch_engine.replicas > 1:
            here = TorchEngine(model, device=device, max_batch=rows)
            engines.append((here, here.clear_cache))
        # The same engine once more, decoding in Python (its replicas forked so): what the
        # compiled step gains.
        compiled = device == "cpu" and native.decode_step() is not None
        python = TorchEngine(model, device=device, max_batch=rows, replicas=0) if compiled else None
        if python is not None:
            engines.append((_PythonStep(python), python.clear_cache))
        runs = _paired_seconds(engines, prompts, params, repeats)
        torch_engine.close()
        if python is not None:
            python.close()
        torch_runs, hf_runs = runs[0], runs[1]
        ratios = [h / t for t, h in zip(torch_runs, hf_runs, strict=True)]
        one_process: dict[str, float] = {}
        if torch_engine.replicas > 1:
            one_process = _paired("one_process", runs[2], torch_runs, batch * new_tokens)
        if compiled:
            one_process |= _paired("python_step", runs[-1], torch_runs, batch * new_tokens)
        torch_s, hf_s = float(np.median(torch_runs)), float(np.median(hf_runs))
        floor_s = _kernel_floor_seconds(
            torch_engine.weights, batch, prompt_tokens, new_tokens, repeats
        )
        produced = batch * new_tokens
        parts: dict[str, float] = {}
        if profile:  # the engine in this process, where the profiler sees its steps
            found = profile_generate(here, prompts, params, repeats=min(repeats, 3))
            parts = {f"profile_{key}": value for key, value in found.items()}
        vllm: dict[str, float] = {}
        if vllm_python is not None:
            vllm_s = _vllm_seconds(
                vllm_python, model, tokenizer, prompts, new_tokens, repeats, checkpoint
            )
            vllm = {
                "vllm_tokens_per_s": produced / vllm_s,
                "vllm_seconds": vllm_s,
                "ratio_vs_vllm": vllm_s / torch_s,
            }

        tree = _tree_workload(
            TorchEngine(model, device=device),
            roots=[random_tokens(prompt_tokens) for _ in range(tree_prompts)],
            samples=tree_samples,
            turns=tree_turns,
            observation=lambda: random_tokens(obs_tokens),
            turn_tokens=turn_tokens,
        )
        return {
            "torch_tokens_per_s": produced / torch_s,
            "hf_tokens_per_s": produced / hf_s,
            "ratio_vs_hf": float(np.median(ratios)),
            "ratio_vs_hf_min": min(ratios),
            "ratio_vs_hf_max": max(ratios),
            **one_process,
            "repeats": float(repeats),
            "torch_seconds": torch_s,
            "hf_seconds": hf_s,
            "floor_seconds": floor_s,
            "floor_ratio_vs_hf": hf_s / floor_s,
            "torch_vs_floor": torch_s / floor_s,
            **vllm,
            "batch": float(batch),
            "new_tokens": float(new_tokens),
            "prompt_tokens": float(prompt_tokens),
            "threads": float(torch.get_num_threads()),
            "replicas": float(torch_engine.replicas),
            "compiled_step": float(compiled),
            **tree,
            **parts,
        }
    finally:
        torch.set_num_threads(saved_threads)


def bench_policy(
    seed: int = 0, checkpoint: Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Callable[[int], list[int]]]:
    """The bench's policy (the tiny one, or ``checkpoint`` in float32) and its draws of
    random prompt tokens (any id but the specials), seeded by ``seed``."""
    if checkpoint is None:
        words = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
        tokenizer = build_word_tokenizer([" ".join(words[:280])])
        model = create_policy(tokenizer, TinyPolicyConfig(), seed=seed)
        first = len(SPECIAL_TOKENS)
    else:
        model, tokenizer = load_checkpoint(checkpoint)
        model.float()
        first = max(tokenizer.all_special_ids, default=-1) + 1
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)

    def random_tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(first, vocab, size=n)]

    return model, tokenizer, random_tokens


class _PythonStep:
    """A TorchEngine's ``generate`` with the Python decode step (``policy.native.off``; the
    replicas it forks in its first call keep to it)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None
    ) -> list[list[Completion]]:
        with native.off():
            return self.engine.generate(prompts, params, seed=seed)


def _paired(name: str, other: list[float], runs: list[float], tokens: int) -> dict[str, float]:
    """``other``'s tokens/s, and its seconds over ``runs``' round by round: the median ratio
    ``ratio_vs_<name>`` with its lowest and highest."""
    ratios = [o / r for o, r in zip(other, runs, strict=True)]
    return {
        f"{name}_tokens_per_s": tokens / float(np.median(other)),
        f"ratio_vs_{name}": float(np.median(ratios)),
        f"ratio_vs_{name}_min": min(ratios),
        f"ratio_vs_{name}_max": max(ratios),
    }


def _paired_seconds(
    engines: Sequence[tuple[Engine, Callable[[], None] | None]],
    prompts: list[list[int]],
    params: SamplingParams,
    repeats: int,
) -> list[list[float]]:
    """Each engine's seconds in each of ``repeats`` rounds, the engines taking turns within a
    round (after one warm-up run each); ``reset`` runs before an engine's every run."""

    def timed(engine: Engine, reset: Callable[[], None] | None, run: int) -> float:
        if reset is not None:
            reset()
        start = time.perf_counter()
        out = engine.generate(prompts, params, seed=run)
        seconds = time.perf_counter() - start
        if sum(len(c.token_ids) for cs in out for c in cs) != len(prompts) * params.max_tokens:
            raise AssertionError("an engine stopped early with no stop token set")
        return seconds

    for engine, reset in engines:  # run 0 warms up
        timed(engine, reset, 0)
    rounds = [[timed(e, reset, run) for e, reset in engines] for run in range(1, repeats + 1)]
    return [list(times) for times in zip(*rounds, strict=True)]


def _vllm_seconds(
    python: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    checkpoint: Path | None = None,
) -> float:
    """Best seconds of vLLM on ``prompts``, timed in ``python`` (see module doc)."""
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        if checkpoint is None:
            save_checkpoint(model, tokenizer, work / "policy")
        (work / "prompts.json").write_text(json.dumps(prompts))
        command = [
            str(python), "-m", "trace_core.bench.vllm_timing",
            "--checkpoint", str(checkpoint or work / "policy"),
            "--prompts", str(work / "prompts.json"),
            "--max-tokens", str(new_tokens), "--repeats", str(repeats),
            "--json", str(work / "vllm.json"),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(
                f"timing vLLM with {python} failed (exit {done.returncode}):\n"
                + done.stderr[-3000:]
            )
        return float(json.loads((work / "vllm.json").read_text())["vllm_seconds"])


def _kernel_floor_seconds(
    weights: DecoderWeights, batch: int, prompt_tokens: int, new_tokens: int, repeats: int
) -> float:
    """Best time of the throughput run's matmuls and attention alone (see module doc)."""
    s = weights.spec
    B, P, C = batch, prompt_tokens, s.hidden_size
    H, Hkv, D, inner = s.num_heads, s.num_kv_heads, s.head_dim, weights.layers[0].down.shape[0]
    dev, dtype = weights.device, weights.dtype

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev, dtype=dtype)

    kv = rand(s.num_layers, 2, B * Hkv, P + new_tokens, D)  # (L, 2, B·Hkv, T, D)
    # Prefill in passes of at most PASS_TOKENS token slots, as TorchEngine runs it.
    per_pass = max(1, min(B, PASS_TOKENS // P))
    passes = -(-B // per_pass)
    n = per_pass * P
    x_pre, att_pre, act_pre = rand(n, C), rand(n, H * D), rand(n, inner)
    q_pre, k_pre, v_pre = (
        rand(per_pass, H, P, D),
        rand(per_pass, Hkv, P, D),
        rand(per_pass, Hkv, P, D),
    )
    x, att, act, q = rand(B, C), rand(B, H * D), rand(B, inner), rand(B * Hkv, H // Hkv, D)

    def run() -> None:
        for _, w in itertools.product(range(passes), weights.layers):  # prefill
            torch.mm(x_pre, w.qkv), torch.mm(att_pre, w.o)
            torch.mm(x_pre, w.gate_up), torch.mm(act_pre, w.down)
            F.scaled_dot_product_attention(q_pre, k_pre, v_pre, is_causal=True, enable_gqa=True)
        torch.mm(x, weights.lm_head)  # the first token's logits
        for t in range(new_tokens):
            span = P + t + 1
            for layer, w in enumerate(weights.layers):
                torch.mm(x, w.qkv)
                scores = torch.bmm(q, kv[layer, 0, :, :span].transpose(1, 2)).softmax(-1)
                torch.bmm(scores, kv[layer, 1, :, :span])
                torch.mm(att, w.o), torch.mm(x, w.gate_up), torch.mm(act, w.down)
            torch.mm(x, weights.lm_head)

    best = float("inf")
    with torch.inference_mode():
        for attempt in range(repeats + 1):  # attempt 0 warms up
            start = time.perf_counter()
            run()
            if attempt:
                best = min(best, time.perf_counter() - start)
    return best


def _tree_workload(
    engine: TorchEngine,
    roots: list[list[int]],
    samples: int,
    turns: int,
    observation: Callable[[], list[int]],
    turn_tokens: int,
) -> dict[str, float]:
    """Multi-turn rollouts with branches; prefill against unique token counts."""
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=turn_tokens)
    one = SamplingParams(n=1, temperature=1.0, max_tokens=turn_tokens)
    sequences: list[list[int]] = []  # every prompt + completion the engine produced
    naive = 0

    def call(prompts: list[list[int]], p: SamplingParams, seed: int) -> list[list[int]]:
        nonlocal naive
        naive += sum(len(x) for x in prompts) * p.n
        out = engine.generate(prompts, p, seed=seed)
        done = [x + c.token_ids.tolist() for x, cs in zip(prompts, out, strict=True) for c in cs]
        sequences.extend(done)
        return done

    first = call(roots, params, seed=0)
    leaves = first
    for turn in range(1, turns):
        leaves = call([x + observation() for x in leaves], one, seed=turn)
    # Branch from the middle of every first turn, as TRACE does from an intermediate node.
    root_of = [r for r in roots for _ in range(samples)]
    mids = [x[: len(r) + turn_tokens // 2] for x, r in zip(first, root_of, strict=True)]
    call(mids, SamplingParams(n=2, temperature=1.0, max_tokens=turn_tokens), seed=turns)

    stats = engine.stats
    return {
        "prefill_tokens": float(stats.prefill_tokens),
        "unique_tokens": float(count_unique_positions(sequences)),
        "generated_tokens": float(stats.generated_tokens),
        "requested_prompt_tokens": float(stats.prompt_tokens),
        "naive_prefill_tokens": float(naive),
        "tree_calls": float(stats.calls),
    }


Trie = dict[int, "Trie"]


def count_unique_positions(sequences: Sequence[Sequence[int]]) -> int:
    """Distinct prefixes among all prefixes of ``sequences``: the nodes of their token trie.

    [[1, 2, 3], [1, 2, 4], [1, 2]] -> prefixes (1), (1 2), (1 2 3), (1 2 4): 4.
    """
    trie: Trie = {}
    count = 0
    for seq in sequences:
        node = trie
        for tok in seq:
            if tok not in node:
                node[tok] = {}
                count += 1
            node = node[tok]
    return count
