"""The GPU check: the three places the policy meets a GPU, each timed on a random-weight model.

1. ``ray_engine``: ``TorchEngine`` inside a Ray actor that asked for one GPU
   (``RayEnginePool(workers=1, num_gpus_per_worker=1)`` on Ray started in this process).
   Tokens/s = generated tokens / wall seconds of ``pool.generate``; the actor reports the
   device, dtype and Ray GPU ids it got.
2. ``ray_update``: one policy update on Ray Train with ``use_gpu=True`` (``update_on_ray``).
   On CUDA the forward runs under bf16 autocast over fp32 master weights
   (``policy.update``); the figures are the wall seconds of ``update_on_ray`` (Ray Train's
   start, loading, the update and saving) and its peak memory (CUDA's max allocated).
3. ``local_engine``: ``TorchEngine`` in this process, for comparison with (1). On CUDA its
   weights and KV are bfloat16 (the engine's default there); on CPU float32.

The model is a ``Qwen3ForCausalLM`` of a real model's shape (``SIZES``: SmolLM2-135M's by
default, or Qwen3-0.6B's) with random weights and a word tokenizer of the same vocabulary
size; weights do not matter for speed. Prompts and sampled tokens are random ids; sampling
has no stop token, so every row generates exactly ``new_tokens``. The update trains on
synthetic one-turn groups (random tokens, half the leaves rewarded, sampling logprob
``-ln V``: what a near-uniform random model gives), so ``logprob_gap`` stays small.

    bash scripts/gpu_check.sh                                   # on the GPU machine
    python -m trace_core.bench.gpu_check --device cpu --small --output build/gpu-check.json

A failing check prints its traceback and one ``FAIL`` line and the others still run; the
JSON is rewritten after every check, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import string
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.policy.engine import Engine, SamplingParams
from trace_core.policy.memory import GIB, ModelShape, estimate_update
from trace_core.policy.model import (
    TinyPolicyConfig,
    create_policy,
    load_checkpoint,
    save_checkpoint,
)
from trace_core.policy.tokenizer import SPECIAL_TOKENS, build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update_config import UpdateConfig
from trace_core.store.schema import write_trees

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class CheckSize:
    """A model shape and the work each check does on it."""

    model: TinyPolicyConfig
    vocab: int
    """Tokenizer (and embedding) size."""
    prompts: int
    """Distinct prompts of one generate call."""
    samples: int
    """Samples per prompt (rows = prompts × samples)."""
    prompt_tokens: int
    new_tokens: int
    repeats: int
    """Timed generate calls after one warm-up call; the best counts."""
    update_prompts: int
    """Trees of the update, one group of ``group`` paths each."""
    group: int
    update_prompt_tokens: int
    update_new_tokens: int
    minibatch: int
    """Paths per optimizer step."""


SIZES = {
    "smollm2-135m": CheckSize(
        TinyPolicyConfig(576, 30, 9, 3, 64, 1536, 8192, 100_000.0), 49_152,
        prompts=32, samples=4, prompt_tokens=128, new_tokens=128, repeats=2,
        update_prompts=8, group=8, update_prompt_tokens=256, update_new_tokens=256, minibatch=32,
    ),
    "qwen3-0.6b": CheckSize(
        TinyPolicyConfig(1024, 28, 16, 8, 128, 3072, 8192, 1_000_000.0), 151_936,
        prompts=32, samples=4, prompt_tokens=128, new_tokens=128, repeats=2,
        update_prompts=8, group=8, update_prompt_tokens=256, update_new_tokens=256, minibatch=32,
    ),
    "small": CheckSize(  # the whole code path on a CPU in seconds
        TinyPolicyConfig(32, 1, 2, 1, 16, 64, 256), 300,
        prompts=4, samples=2, prompt_tokens=8, new_tokens=8, repeats=1,
        update_prompts=2, group=4, update_prompt_tokens=8, update_new_tokens=8, minibatch=8,
    ),
}  # fmt: skip
"""SmolLM2-135M's and Qwen3-0.6B's dimensions (hidden, layers, heads, KV heads, head dim,
MLP width, positions, rope theta; vocabulary); ``small`` for a CPU smoke run."""


@dataclass(frozen=True)
class GpuCheckConfig:
    device: str = "cuda"
    """cuda (refused when torch sees no GPU) or cpu (the same code path, for CI)."""
    shape: str = "smollm2-135m"
    """A key of ``SIZES``."""
    seed: int = 0
    """Seed of the weights, prompts, trees and sampling."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.shape not in SIZES:
            raise ValueError(f"shape must be one of {', '.join(SIZES)}, got {self.shape!r}")

    @property
    def size(self) -> CheckSize:
        return SIZES[self.shape]


@dataclass(frozen=True)
class EngineFigures:
    tokens_per_s: float
    """Generated tokens / wall seconds of the best timed call."""
    generated_tokens: int
    seconds: float
    start_seconds: float
    """Building the engine (for Ray: starting the actor, which loads the checkpoint)."""
    device: str
    """Where the engine ran, as it reports: device, dtype, GPU name (and Ray GPU ids)."""


@dataclass(frozen=True)
class UpdateFigures:
    seconds: float
    """Wall seconds of ``update_on_ray``: Ray Train's start, loading, the update, saving."""
    peak_gib: float
    """The update's peak: CUDA's max allocated on a GPU, the worker's peak RSS on CPU."""
    held_gib: float
    """What the worker held when the update began (model and optimizer state)."""
    estimate_gib: float
    """``policy.memory``'s estimate of that peak (on CPU it leaves out the process itself)."""
    paths: int
    tokens: int
    steps: int
    logprob_gap: float
    use_gpu: bool


@dataclass
class GpuCheckResult:
    config: dict[str, object]
    environment: dict[str, str]
    ray_engine: EngineFigures | None = None
    ray_update: UpdateFigures | None = None
    local_engine: EngineFigures | None = None
    errors: dict[str, str] = field(default_factory=dict)
    """Check name -> the one line its failure printed."""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"config": self.config, "environment": self.environment}
        for name in ("ray_engine", "ray_update", "local_engine"):
            figures = getattr(self, name)
            out[name] = None if figures is None else asdict(figures)
        if self.ray_engine and self.local_engine:
            out["ray_over_local"] = self.ray_engine.tokens_per_s / self.local_engine.tokens_per_s
        out["errors"] = self.errors
        return out


def check_device(device: str) -> None:
    """Refuse ``cuda`` when torch sees no GPU, saying why, before any work starts."""
    if device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{build}); run this on a machine with an NVIDIA GPU and a CUDA torch, "
            f"or pass --device cpu"
        )


def run_gpu_check(
    config: GpuCheckConfig,
    say: Callable[[str], None] = print,
    output: Path | None = None,
) -> GpuCheckResult:
    """Build the model, then run the three checks in turn (see the module docstring);
    ``output``: a JSON file rewritten after every check."""
    from trace_core.rollout.ray_pool import ray_session

    check_device(config.device)
    size = config.size
    result = GpuCheckResult(
        config={**asdict(config), "size": asdict(size)},
        environment=describe_environment(config.device),
    )
    say("environment: " + ", ".join(f"{k} {v}" for k, v in result.environment.items()))
    rng = np.random.default_rng(config.seed)
    # Ray is shut down before the folder goes: its workers read the checkpoint from it.
    with (
        tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp,
        ray_session(num_cpus=max(2, os.cpu_count() or 1)),
    ):
        policy, trees = Path(tmp) / "policy", Path(tmp) / "trees.parquet"
        start = time.perf_counter()
        tokenizer = build_vocabulary(size.vocab)
        model = create_policy(tokenizer, size.model, seed=config.seed)
        save_checkpoint(model, tokenizer, policy)
        write_trees(trees, synthetic_trees(size, len(tokenizer), rng))
        params = sum(p.numel() for p in model.parameters())
        del model
        say(
            f"model: {config.shape}, {params:,} parameters, vocabulary "
            f"{len(tokenizer):,}; written with the trees in {time.perf_counter() - start:.1f} s"
        )
        checks: tuple[tuple[str, Callable[[], EngineFigures | UpdateFigures]], ...] = (
            ("ray_engine", lambda: check_ray_engine(policy, size, config.device, rng)),
            ("ray_update", lambda: check_ray_update(policy, trees, size, config.device)),
            ("local_engine", lambda: check_local_engine(policy, size, config.device, rng)),
        )
        for name, check in checks:
            say(f"{name}: running")
            try:
                figures = check()
            except Exception as err:
                traceback.print_exc()
                line = f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]
                result.errors[name] = line
                say(f"FAIL {name}: {line}")
            else:
                setattr(result, name, figures)
                say(figure_line(name, figures))
            if output is not None:
                write_result(output, result)
    if result.ray_engine and result.local_engine:
        ratio = result.ray_engine.tokens_per_s / result.local_engine.tokens_per_s
        say(f"ray_engine / local_engine tokens/s: {ratio:.2f}×")
    return result


# -- the checks ---------------------------------------------------------------------------------


def check_ray_engine(
    policy: Path, size: CheckSize, device: str, rng: np.random.Generator
) -> EngineFigures:
    import ray

    from trace_core.rollout.ray_pool import RayEnginePool

    gpus = 1 if device == "cuda" else 0
    require_ray_gpus(gpus)
    start = time.perf_counter()
    with RayEnginePool(
        policy, workers=1, num_gpus_per_worker=gpus, engine="torch", ready_timeout_s=600
    ) as pool:
        started = time.perf_counter() - start
        # The pool does not hand out its actors; a check may look inside to ask the engine.
        where = str(ray.get(pool._actors[0].__ray_call__.remote(_actor_device), timeout=120))
        tokens, seconds = time_generation(pool, size, rng)
    return EngineFigures(tokens / seconds, tokens, seconds, started, where)


def check_ray_update(policy: Path, trees: Path, size: CheckSize, device: str) -> UpdateFigures:
    from trace_core.train.ray_update import update_on_ray

    use_gpu = device == "cuda"
    require_ray_gpus(1 if use_gpu else 0)
    config = UpdateConfig(lr=1e-5, minibatch=size.minibatch)
    start = time.perf_counter()
    stats = update_on_ray(
        policy, trees, policy.with_name("updated"), config, seed=0, workers=1, use_gpu=use_gpu
    )
    seconds = time.perf_counter() - start
    if stats.steps == 0:
        raise RuntimeError(f"the update took no step on {stats.paths} paths")
    m = size.model
    shape = ModelShape(
        m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
        m.intermediate_size, size.vocab, tied=True,
    )  # fmt: skip
    pass_tokens = size.minibatch * (size.update_prompt_tokens + size.update_new_tokens)
    estimate = estimate_update(shape, pass_tokens, checkpointing=False, device=device)
    return UpdateFigures(
        seconds, stats.peak_gib, stats.held_gib, estimate.total / GIB, stats.paths,
        stats.tokens, stats.steps, stats.logprob_gap, use_gpu,
    )  # fmt: skip


def check_local_engine(
    policy: Path, size: CheckSize, device: str, rng: np.random.Generator
) -> EngineFigures:
    start = time.perf_counter()
    model, _ = load_checkpoint(policy)
    engine = TorchEngine(model, device=device)  # bfloat16 on CUDA: the engine's default there
    del model
    started = time.perf_counter() - start
    tokens, seconds = time_generation(engine, size, rng)
    return EngineFigures(
        tokens / seconds, tokens, seconds, started, engine_device(engine.device, engine.dtype)
    )


def time_generation(engine: Engine, size: CheckSize, rng: np.random.Generator) -> tuple[int, float]:
    """(generated tokens, seconds) of the fastest of ``size.repeats`` calls, after a short
    warm-up call (CUDA context, kernels). Every call has fresh prompts: nothing is cached."""
    vocab_low = len(SPECIAL_TOKENS)  # prompts hold no special token
    vocab = int(size.vocab)

    def prompts() -> list[list[int]]:
        ids = rng.integers(vocab_low, vocab, size=(size.prompts, size.prompt_tokens))
        return ids.tolist()  # type: ignore[no-any-return]

    warm = SamplingParams(n=size.samples, max_tokens=min(8, size.new_tokens))
    engine.generate(prompts(), warm, seed=0)
    params = SamplingParams(n=size.samples, max_tokens=size.new_tokens)
    best: tuple[int, float] | None = None
    for r in range(size.repeats):
        batch = prompts()
        start = time.perf_counter()
        out = engine.generate(batch, params, seed=r + 1)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for row in out for c in row)
        if best is None or tokens / seconds > best[0] / best[1]:
            best = (tokens, seconds)
    assert best is not None
    return best


def require_ray_gpus(gpus: int) -> None:
    """Fail at once when Ray has fewer GPUs than asked (an actor would wait for one forever)."""
    import ray

    have = ray.cluster_resources().get("GPU", 0.0)
    if have < gpus:
        raise RuntimeError(
            f"Ray sees {have:g} GPUs on this machine and the check needs {gpus} "
            f"(torch sees {torch.cuda.device_count()}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


def _actor_device(worker: object) -> str:
    """Runs inside the engine actor (``__ray_call__``): where its engine put the weights."""
    import ray

    engine: TorchEngine = worker.engine  # type: ignore[attr-defined]
    return f"{engine_device(engine.device, engine.dtype)}, Ray GPU ids {ray.get_gpu_ids()}"


def engine_device(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    index = f":{torch.cuda.current_device()}" if device.type == "cuda" else ""
    return f"{device.type}{index} {str(dtype).removeprefix('torch.')} {name}"


# -- the model and the trees ---------------------------------------------------------------------


def build_vocabulary(size: int) -> PreTrainedTokenizerFast:
    """A word tokenizer with exactly ``size`` tokens: its fixed pieces, then 4-letter words."""
    fixed = len(build_word_tokenizer([]))
    if size <= fixed:
        raise ValueError(f"vocab must exceed the tokenizer's {fixed} fixed tokens, got {size}")
    letters = itertools.product(string.ascii_lowercase, repeat=4)
    words = ["".join(w) for w in itertools.islice(letters, size - fixed)]
    tokenizer = build_word_tokenizer([" ".join(words)])
    assert len(tokenizer) == size, (len(tokenizer), size)
    return tokenizer


def synthetic_trees(size: CheckSize, vocab: int, rng: np.random.Generator) -> list[RolloutTree]:
    """One-turn groups of random tokens, every other leaf rewarded (so no group is flat);
    the sampling logprob of every token is ``-ln vocab``."""
    low, logprob = len(SPECIAL_TOKENS), -math.log(vocab)
    trees = []
    for p in range(size.update_prompts):
        prompt = rng.integers(low, vocab, size=size.update_prompt_tokens)
        info = TreeInfo(prompt_id=f"gpu-check-{p}", tree_id=p, strategy="grpo")
        builder = TreeBuilder(info, prompt_tokens=prompt.astype(np.int32))
        for k in range(size.group):
            leaf = builder.add_turn(
                0,
                gen_tokens=rng.integers(low, vocab, size=size.update_new_tokens),
                logprobs=np.full(size.update_new_tokens, logprob),
            )
            builder.set_reward(leaf, float(k % 2))
        trees.append(builder.build())
    return trees


# -- output ---------------------------------------------------------------------------------


def describe_environment(device: str) -> dict[str, str]:
    import ray
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        "cpus": str(os.cpu_count()),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = (
            f"{torch.cuda.device_count()} × {props.name} ({props.total_memory / GIB:.0f} GiB)"
        )
    return env


def figure_line(name: str, f: EngineFigures | UpdateFigures) -> str:
    if isinstance(f, EngineFigures):
        return (
            f"{name}: {f.tokens_per_s:,.0f} tokens/s ({f.generated_tokens:,} tokens in "
            f"{f.seconds:.2f} s; engine up in {f.start_seconds:.1f} s) on {f.device}"
        )
    where = "GPU, bf16 autocast" if f.use_gpu else "CPU"
    return (
        f"{name}: {f.seconds:.1f} s for {f.steps} steps over {f.paths} paths ({f.tokens:,} "
        f"tokens), peak {f.peak_gib:.2f} GiB (estimate {f.estimate_gib:.2f}, held "
        f"{f.held_gib:.2f}) on {where}; logprob gap {f.logprob_gap:.3f}"
    )


def write_result(path: Path, result: GpuCheckResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m trace_core.bench.gpu_check``: what ``scripts/gpu_check.sh`` runs (it needs
    none of the command line's dependencies). Exit 0: every check passed; 1: one failed;
    2: a refused option or no GPU."""
    parser = argparse.ArgumentParser(
        prog="gpu_check", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--device", choices=DEVICES, default="cuda", help="default: cuda")
    parser.add_argument("--shape", choices=list(SIZES), default="smollm2-135m", help="model size")
    parser.add_argument("--small", action="store_true", help="same as --shape small (CPU, CI)")
    parser.add_argument("--output", "--json", type=Path, default=Path("build/gpu-check.json"))
    args = parser.parse_args(argv)
    try:
        config = GpuCheckConfig(device=args.device, shape="small" if args.small else args.shape)
        check_device(config.device)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = run_gpu_check(config, say=lambda line: print(line, flush=True), output=args.output)
    print(f"wrote {args.output}")
    if result.errors:
        print(f"FAILED: {', '.join(result.errors)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
