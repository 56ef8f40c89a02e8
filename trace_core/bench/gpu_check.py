"""The GPU check: what must hold for the policy on a GPU, measured stage by stage, each with a
pass/fail threshold. It needs torch, transformers, safetensors, numpy and pyarrow only: no Ray,
no vLLM, no network, no pretrained weights (models are randomly initialised at real shapes).

    bash scripts/gpu_check.sh --json build/gpu-check.json     # on a GPU machine (391 s, H200)
    bash scripts/gpu_check.sh --smoke --json F                 # every stage on CPU at tiny shapes

Stages (the JSON has one entry each: ``name``, ``status`` pass/fail/skip, ``threshold``, and
its figures):

- ``environment``: torch, CUDA, NCCL, the device; a large bf16 matmul's TFLOP/s, which must
  reach 40% of the device's dense bf16 peak where the peak is known (``PEAK_TFLOPS``).
- ``dtype_guard``: a policy stored in bf16 trains on fp32 master weights: one AdamW step at
  lr 1e-6 moves ≥ 90% of the weights by lr (median |Δ|/lr in [0.9, 1.1]), where the same step
  on bf16 weights moves < 10% of them; the engines' copy is written back in bf16.
- ``update``: the update at Qwen3-8B's layer shape with a few layers, fp32 master weights and
  bf16 autocast: tokens/s, MFU, peak memory against ``policy.memory``'s estimate (within ±20%),
  with and without gradient checkpointing; the 36-layer peak extrapolated from two depths.
- ``old_recompute``: with π_old recomputed, the first step's ratio is 1 (max |ρ − 1| ≤ 1e-6)
  and the first update clips nothing.
- ``parity``: TorchEngine samples (256 rows × 256 tokens at Qwen3-0.6B's shape, a peaked
  output layer) and the trainer scores them in bf16: mean |Δ logprob| ≤ 0.05, p99 ≤ 0.5, and
  the share of tokens truncated by TIS at C = 2 (Yao et al.; ``tis_cap`` is off by default)
  ≤ 1%. On CPU in fp32 the gaps must be ≤ 1e-3.
- ``decode``: TorchEngine decode tokens/s at batch 1, 64 and 256 against the HBM roofline
  (weights and KV bytes read per step over the bandwidth, ``HBM_TBPS``); the ratio must stay
  ≤ 1 and batching must raise tokens/s.
- ``continuous``: one workload of 4 × 256 requests of varied length on one TorchEngine
  (``bench.gpu_continuous``), fed in sub-batches of 256 and then continuously: the same
  tokens (≥ 90% of requests), and on a GPU continuous ≥ 1.25× the sub-batches' tokens/s; the
  decode step's milliseconds against its rows.
- ``reload``: a safetensors file (4 GB; 64 MB in the smoke run) dropped from the page cache and
  loaded into device memory: GB/s, ≥ 0.5 (on CPU safetensors maps the file: skip).
- ``sync``: the resident session's weight sync between a trainer process and a TorchEngine
  process on the same device at Qwen3-1.7B's shape (``bench.gpu_sync``): seconds and GB/s per
  backend, ≥ 1 GB/s over gloo, and the engine then decodes what the trainer's weights decode.

On CPU (``--smoke``) a stage that needs CUDA for its threshold reports ``skip`` with its
figures. The JSON is rewritten after every stage, so a run cut short keeps what it measured.
Exit 0 when no stage failed, 1 when one did, 2 for a bad option or no GPU without --smoke.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trace_core.bench.gpu_continuous import stage_continuous
from trace_core.bench.gpu_shapes import (
    QWEN3_06B,
    QWEN3_8B,
    QWEN3_17B,
    TINY,
    Shape,
    peaked,
    synthetic_trees,
)
from trace_core.bench.gpu_sync import stage_sync
from trace_core.policy.engine import SamplingParams
from trace_core.policy.memory import GIB, estimate_update
from trace_core.policy.model import (
    checkpoint_dtype,
    load_checkpoint,
    load_for_training,
    save_checkpoint,
)
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import (
    TokenScorer,
    collate_paths,
    make_optimizer,
    pack,
    trainer_logprobs,
    tree_paths,
    update_policy,
)
from trace_core.policy.update_config import UpdateConfig

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}
"""Dense bf16 peak TFLOP/s by a word of the device's name (the vendors' figures)."""
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "A10G": 0.6}
"""Memory bandwidth TB/s by a word of the device's name; unknown devices: 1.0 (low, so the
ratio stays an upper bound of what is reached)."""


@dataclass(frozen=True)
class Plan:
    """How big each stage's work is: the GPU run's, or the smoke run's on CPU."""

    device: str
    update_shape: Shape
    update_layers: tuple[int, int]
    """Two depths of the update stage (the peak per layer is their slope)."""
    update_paths: int
    update_tokens: tuple[int, int]
    """Prompt and generated tokens of each path."""
    parity_shape: Shape
    rows: int
    prompt_tokens: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    decode_tokens: int
    reload_bytes: int
    matmul: int
    sync_shape: Shape
    sync_rounds: int


GPU_PLAN = Plan(
    "cuda", QWEN3_8B, (2, 4), 8, (512, 512), QWEN3_06B, 256, 64, 256, (1, 64, 256), 128,
    4 * 10**9, 8192, QWEN3_17B, 3,
)  # fmt: skip
SMOKE_PLAN = Plan(
    "cpu", TINY, (1, 2), 4, (16, 16), TINY, 8, 8, 16, (1, 4, 8), 8, 64 * 2**20, 256, TINY, 2
)  # fmt: skip


@dataclass
class Stage:
    name: str
    status: str = "pass"
    threshold: str = ""
    figures: dict[str, object] = field(default_factory=dict)
    reason: str = ""
    """Why a stage failed or was skipped."""

    def fail(self, reason: str) -> None:
        self.status, self.reason = "fail", reason

    def skip(self, reason: str) -> None:
        if self.status != "fail":
            self.status, self.reason = "skip", reason


def device_word(table: dict[str, float]) -> float | None:
    """The table's figure for this machine's GPU (a word of its name), None if unknown."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((value for word, value in table.items() if word in name), None)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- the stages ----------------------------------------------------------------------------
def stage_environment(plan: Plan, stage: Stage) -> None:
    import safetensors
    import transformers

    stage.threshold = "bf16 matmul ≥ 40% of the device's dense bf16 peak (GPU, known peak)"
    figures = stage.figures
    figures.update(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        cuda=torch.version.cuda or "none",
        cpus=os.cpu_count(),
    )
    if plan.device == "cuda":
        figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        props = torch.cuda.get_device_properties(0)
        figures["device"] = f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
    dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    n = plan.matmul
    a = torch.randn(n, n, device=plan.device, dtype=dtype)
    b = torch.randn(n, n, device=plan.device, dtype=dtype)
    a @ b  # warm-up
    synchronize(plan.device)
    repeats = 20 if plan.device == "cuda" else 3
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(plan.device)
    tflops = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    figures["matmul_tflops"] = tflops
    peak = device_word(PEAK_TFLOPS)
    if plan.device != "cuda" or peak is None:
        stage.skip("no known bf16 peak for this device")
        return
    figures["peak_tflops"], figures["matmul_share"] = peak, tflops / peak
    if tflops < 0.4 * peak:
        stage.fail(f"{tflops:.0f} TFLOP/s is under 40% of {peak:.0f}")


def stage_dtype_guard(plan: Plan, stage: Stage) -> None:
    stage.threshold = (
        "fp32 master: ≥ 90% of weights move, median |Δ|/lr in [0.9, 1.1]; bf16 weights: < 10% "
        "move; the written checkpoint is bf16"
    )
    lr = 1e-6
    tokenizer = build_word_tokenizer(["0 1 2 3 4 5 6 7 8 9 a b c d e f g h"])
    shape = Shape(2, 128, 4, 2, 32, 256, len(tokenizer), tied=True)
    trees = synthetic_trees(4, 4, (8, 8), shape.vocab, np.random.default_rng(1))
    config = UpdateConfig(lr=lr, minibatch=1000)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        stored = Path(tmp) / "bf16"
        save_checkpoint(shape.model(0).to(torch.bfloat16), tokenizer, stored)
        master, _, serving = load_for_training(stored, plan.device)
        before = [p.detach().clone() for p in master.parameters()]
        stats = update_policy(
            master, make_optimizer(master, config), trees, config, np.random.default_rng(0),
            serving=serving,
        )  # fmt: skip
        moved, ratios = 0, []
        for p, b in zip(master.parameters(), before, strict=True):
            delta = (p.detach() - b).abs()
            moved += int((delta > 0).sum())
            ratios.append((delta / lr).flatten())
        total = sum(b.numel() for b in before)
        median = float(torch.cat(ratios).median())
        rounded, _ = load_checkpoint(stored, plan.device)
        bf16_before = [p.detach().clone() for p in rounded.parameters()]
        update_policy(
            rounded, make_optimizer(rounded, config), trees, config, np.random.default_rng(0),
            serving=serving,
        )  # fmt: skip
        bf16_moved = sum(
            int((p.detach() != b).sum())
            for p, b in zip(rounded.parameters(), bf16_before, strict=True)
        )
        written = Path(tmp) / "written"
        save_checkpoint(master, tokenizer, written, dtype=serving)
        written_dtype = str(checkpoint_dtype(written)).removeprefix("torch.")
    stage.figures.update(
        master_dtype=stats.master_dtype, compute_dtype=stats.compute_dtype,
        moved_share=moved / total, median_step_over_lr=median,
        bf16_moved_share=bf16_moved / total, written_dtype=written_dtype,
    )  # fmt: skip
    if stats.master_dtype != "float32":
        stage.fail(f"the master weights are {stats.master_dtype}")
    elif moved / total < 0.9 or not 0.9 <= median <= 1.1:
        stage.fail(f"{moved / total:.1%} of the weights moved, median step {median:.2f} × lr")
    elif bf16_moved / total >= 0.1:
        stage.fail(f"bf16 weights kept {bf16_moved / total:.1%} of the steps: lr too large")
    elif written_dtype != "bfloat16":
        stage.fail(f"the engines' checkpoint was written in {written_dtype}")


def stage_update(plan: Plan, stage: Stage) -> None:
    stage.threshold = (
        "peak memory within ±20% of policy.memory's estimate, with and without checkpointing "
        "(GPU; on CPU the peak is the process's RSS, not compared)"
    )
    shape, (low, high) = plan.update_shape, plan.update_layers
    tokens_per_path = sum(plan.update_tokens)
    micro = plan.update_paths * tokens_per_path
    trees = synthetic_trees(
        plan.update_paths // 2, 2, plan.update_tokens, shape.vocab, np.random.default_rng(2)
    )
    figures: dict[str, object] = {"shape": "Qwen3-8B layers" if plan.device == "cuda" else "tiny"}
    for checkpointing in (False, True):
        peaks = {}
        for layers in (low, high):
            model = shape.model(0, layers).to(plan.device)
            config = UpdateConfig(
                lr=1e-6, minibatch=plan.update_paths, micro_tokens=micro,
                checkpointing=checkpointing, skip_flat_paths=False,
            )  # fmt: skip
            optimizer = make_optimizer(model, config)
            if plan.device == "cuda":
                torch.cuda.empty_cache()
            synchronize(plan.device)
            start = time.perf_counter()
            stats = update_policy(model, optimizer, trees, config, np.random.default_rng(0))
            synchronize(plan.device)
            seconds = time.perf_counter() - start
            peaks[layers] = stats.peak_gib
            if layers == high:
                params = sum(p.numel() for p in model.parameters())
                embedding = shape.vocab * shape.hidden
                tokens = plan.update_paths * tokens_per_path
                estimate = (
                    estimate_update(
                        shape.memory_shape(layers), micro, checkpointing, plan.device
                    ).total
                    / GIB
                )
                key = "checkpointing" if checkpointing else "plain"
                flops = 6 * (params - embedding) * tokens
                peak = device_word(PEAK_TFLOPS)
                figures[key] = {
                    "layers": layers,
                    "tokens_per_s": tokens / seconds,
                    "mfu": flops / seconds / (peak * 1e12) if peak else None,
                    "peak_gib": stats.peak_gib,
                    "estimate_gib": estimate,
                    "peak_over_estimate": stats.peak_gib / estimate,
                    "peak_gib_at_36_layers": stats.peak_gib
                    + (36 - high) * (peaks[high] - peaks[low]) / (high - low),
                    "steps": stats.steps,
                }
            del model, optimizer
        if plan.device == "cuda":
            ratio = figures[key]["peak_over_estimate"]  # type: ignore[index]
            if not 0.8 <= ratio <= 1.2:
                stage.fail(f"{key}: peak {ratio:.2f} × the estimate")
    stage.figures.update(figures)
    if plan.device != "cuda":
        stage.skip("on CPU the peak is the process's RSS, which the estimate leaves out")


def stage_old_recompute(plan: Plan, stage: Stage) -> None:
    stage.threshold = "π_old recomputed: max |ρ − 1| of the first step ≤ 1e-6, clip fraction 0"
    shape = plan.parity_shape if plan.device == "cuda" else TINY
    model = shape.model(0, min(shape.layers, 4)).to(plan.device)
    trees = synthetic_trees(4, 4, (32, 32), shape.vocab, np.random.default_rng(3))
    config = UpdateConfig(lr=1e-6, minibatch=1000, old_logprobs="recompute", micro_tokens=512)
    paths = tree_paths(trees, config.estimator)
    scorer = TokenScorer(model, config.logit_chunk)
    device = torch.device(plan.device)
    old = trainer_logprobs(scorer, paths, config.micro_tokens, 0, device)
    model.train()
    worst = 0.0
    # The first step's forward, with grad, in the same micro-batches as the recomputation.
    for part in pack([len(p.tokens) for p in paths], config.micro_tokens):
        batch = collate_paths([paths[i] for i in part], 0, [old[i] for i in part])
        mask = batch.mask.to(device)
        new = scorer(batch.ids.to(device), batch.attention.to(device), mask)
        reference = batch.old_logprobs.to(device)[mask]
        worst = max(worst, float((torch.exp(new.detach() - reference) - 1).abs().max()))
    model.eval()
    stats = update_policy(
        model, make_optimizer(model, config), trees, config, np.random.default_rng(0)
    )
    stage.figures.update(max_ratio_error=worst, clip_fraction=stats.clip_fraction)
    if worst > 1e-6 or stats.clip_fraction != 0:
        stage.fail(f"max |ρ − 1| {worst:.2e}, clip fraction {stats.clip_fraction}")


def stage_parity(plan: Plan, stage: Stage) -> None:
    cuda = plan.device == "cuda"
    stage.threshold = (
        "bf16: mean |Δ logprob| ≤ 0.05, p99 ≤ 0.5, TIS (C = 2) truncates ≤ 1% of tokens"
        if cuda
        else "fp32 on CPU: mean and p99 |Δ logprob| ≤ 1e-3"
    )
    shape = plan.parity_shape
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model = peaked(shape.model(0))
        tokenizer = build_word_tokenizer(["a b c"])  # saved beside; the ids here are random
        save_checkpoint(model, tokenizer, Path(tmp) / "policy")
        del model
        serving, _ = load_checkpoint(Path(tmp) / "policy")
        engine = TorchEngine(
            serving, device=plan.device, max_batch=plan.rows,
            cache_tokens=2 * plan.rows * (plan.prompt_tokens + plan.new_tokens),
        )  # fmt: skip
        del serving
        prompts, samples = plan.rows // 8, 8
        rng = np.random.default_rng(4)
        batch = rng.integers(4, shape.vocab, size=(prompts, plan.prompt_tokens)).tolist()
        out = engine.generate(batch, SamplingParams(n=samples, max_tokens=plan.new_tokens), seed=0)
        del engine
        trainer, _, _ = load_for_training(Path(tmp) / "policy", plan.device)
    scorer = TokenScorer(trainer)
    gaps, tis = [], []
    device = torch.device(plan.device)
    with torch.no_grad():
        for prompt, completions in zip(batch, out, strict=True):
            rows = [prompt + c.token_ids.tolist() for c in completions]
            width = max(len(r) for r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
            mask = torch.zeros((len(rows), width - 1), dtype=torch.bool, device=device)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.as_tensor(row, device=device)
                mask[i, len(prompt) - 1 : len(row) - 1] = True
            lengths = torch.as_tensor([len(r) for r in rows], device=device)
            attention = (torch.arange(width, device=device)[None] < lengths[:, None]).long()
            mine = scorer(ids, attention, mask).float().cpu().numpy()
            theirs = np.concatenate([c.logprobs for c in completions])
            gaps.append(np.abs(mine - theirs))
            tis.append(np.exp(mine - theirs) > 2.0)
    gap, truncated = np.concatenate(gaps), np.concatenate(tis)
    mean, p99 = float(gap.mean()), float(np.quantile(gap, 0.99))
    nll = float(-np.mean(np.concatenate([c.logprobs for row in out for c in row])))
    stage.figures.update(
        tokens=int(gap.size), mean_gap=mean, p99_gap=p99,
        tis_truncated_share=float(truncated.mean()), tis_cap=2.0, mean_sampled_nll=nll,
    )  # fmt: skip
    if cuda and (mean > 0.05 or p99 > 0.5 or truncated.mean() > 0.01):
        stage.fail(f"mean {mean:.3f}, p99 {p99:.3f}, TIS share {truncated.mean():.3%}")
    if not cuda and (mean > 1e-3 or p99 > 1e-3):
        stage.fail(f"mean {mean:.2e}, p99 {p99:.2e} in fp32")


def stage_decode(plan: Plan, stage: Stage) -> None:
    stage.threshold = "tokens/s ≤ the HBM roofline at every batch; batch 256 faster than 1 (GPU)"
    shape = plan.parity_shape
    model = shape.model(0)
    params = sum(p.numel() for p in model.parameters())
    dtype_bytes = 2 if plan.device == "cuda" else 4
    context = plan.prompt_tokens + plan.decode_tokens
    engine = TorchEngine(
        model, device=plan.device, max_batch=max(plan.decode_batches),
        cache_tokens=2 * max(plan.decode_batches) * context,
    )  # fmt: skip
    del model
    bandwidth = device_word(HBM_TBPS) or 1.0
    rng = np.random.default_rng(5)
    figures: dict[str, object] = {"bandwidth_tbps": bandwidth, "parameters": params}
    rates = {}
    for batch in plan.decode_batches:
        prompts = rng.integers(4, shape.vocab, size=(batch, plan.prompt_tokens)).tolist()
        params_ = SamplingParams(max_tokens=plan.decode_tokens)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2), seed=0)  # warm-up
        synchronize(plan.device)
        start = time.perf_counter()
        out = engine.generate(prompts, params_, seed=1)
        synchronize(plan.device)
        seconds = time.perf_counter() - start
        generated = sum(len(c.token_ids) for row in out for c in row)
        kv = batch * context * shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes
        step_bytes = params * dtype_bytes + kv / 2  # the KV read grows from prompt to context
        roofline = batch / (step_bytes / (bandwidth * 1e12))
        rates[batch] = generated / seconds
        figures[f"batch_{batch}"] = {
            "tokens_per_s": generated / seconds,
            "roofline_tokens_per_s": roofline,
            "ratio": generated / seconds / roofline,
        }
    stage.figures.update(figures)
    if plan.device != "cuda":
        stage.skip("no HBM roofline on a CPU")
        return
    low, high = min(plan.decode_batches), max(plan.decode_batches)
    if any(f["ratio"] > 1 for f in figures.values() if isinstance(f, dict)):  # type: ignore[index]
        stage.fail("a batch decodes faster than the HBM roofline: the model of bytes is wrong")
    elif rates[high] <= rates[low]:
        stage.fail(f"batch {high} decodes no faster than batch {low}")


def stage_reload(plan: Plan, stage: Stage) -> None:
    from safetensors.torch import load_file, save_file

    stage.threshold = "≥ 0.5 GB/s from local disk into device memory"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        path = Path(tmp) / "weights.safetensors"
        chunk = min(256 * 2**20, plan.reload_bytes)  # bytes of one tensor
        tensors = {
            f"w{i}": torch.full((chunk // 2,), float(i), dtype=torch.bfloat16)
            for i in range(max(1, plan.reload_bytes // chunk))
        }
        save_file(tensors, str(path))
        size = path.stat().st_size
        del tensors
        with open(path, "rb") as f:  # out of the page cache: read from the disk
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        synchronize(plan.device)
        start = time.perf_counter()
        loaded = load_file(str(path), device=plan.device)
        synchronize(plan.device)
        seconds = time.perf_counter() - start
    rate = size / seconds / 1e9
    stage.figures.update(bytes=size, seconds=seconds, gb_per_s=rate, tensors=len(loaded))
    if plan.device != "cuda":  # safetensors maps the file: nothing is copied to a device
        stage.skip("on CPU the file is memory-mapped, not copied")
    elif rate < 0.5:
        stage.fail(f"{rate:.2f} GB/s")


STAGES: tuple[tuple[str, Callable[[Plan, Stage], None]], ...] = (
    ("environment", stage_environment),
    ("dtype_guard", stage_dtype_guard),
    ("update", stage_update),
    ("old_recompute", stage_old_recompute),
    ("parity", stage_parity),
    ("decode", stage_decode),
    ("continuous", stage_continuous),
    ("reload", stage_reload),
    ("sync", stage_sync),
)


# -- running --------------------------------------------------------------------------------------
def run(
    plan: Plan, output: Path, names: list[str] | None = None, say: Callable[[str], None] = print
) -> list[Stage]:
    """The stages ``names`` (default: every one) in that order; the JSON is rewritten after
    each."""
    bodies = dict(STAGES)
    stages: list[Stage] = []
    for name in names or list(bodies):
        body = bodies[name]
        stage = Stage(name)
        start = time.perf_counter()
        try:
            body(plan, stage)
        except Exception as err:  # a broken stage fails alone; the others still run
            traceback.print_exc()
            stage.fail(f"{type(err).__name__}: {' '.join(str(err).split())}"[:500])
        stage.figures["seconds"] = time.perf_counter() - start
        stages.append(stage)
        say(stage_line(stage))
        write_json(output, plan, stages)
    return stages


def stage_line(stage: Stage) -> str:
    shown = ", ".join(
        f"{k} {format_value(v)}"
        for k, v in stage.figures.items()
        if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))
    )
    why = f" ({stage.reason})" if stage.reason else ""
    return f"{stage.status.upper():4} {stage.name}{why}: {shown}"


def format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def write_json(path: Path, plan: Plan, stages: list[Stage]) -> None:
    body = {
        "device": plan.device,
        "smoke": plan.device == "cpu",
        "stages": [
            {
                "name": s.name,
                "status": s.status,
                "threshold": s.threshold,
                "reason": s.reason,
                **s.figures,
            }
            for s in stages
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(temp, path)


def main(argv: list[str] | None = None) -> int:
    """What ``scripts/gpu_check.sh`` runs. Exit 0: no stage failed; 1: one did; 2: bad usage."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every stage on CPU, tiny shapes")
    parser.add_argument("--json", type=Path, default=Path("build/gpu-check.json"))
    parser.add_argument(
        "--stages", default="", help="comma-separated stage names to run (default: every one)"
    )
    args = parser.parse_args(argv)
    names = [name for name, _ in STAGES]
    chosen = [n.strip() for n in args.stages.split(",") if n.strip()] or names
    if unknown := [n for n in chosen if n not in names]:
        parser.error(f"--stages: no stage {', '.join(unknown)}; the stages are {', '.join(names)}")
    if not args.smoke and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu-check: torch {torch.__version__} ({build}) sees no GPU; run it on a machine "
            "with one, or pass --smoke for the CPU run",
            file=sys.stderr,
        )
        return 2
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    if args.smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    stages = run(plan, args.json, chosen, say=lambda line: print(line, flush=True))
    failed = [s.name for s in stages if s.status == "fail"]
    print(
        f"wrote {args.json}; " + (f"FAILED: {', '.join(failed)}" if failed else "no stage failed")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
