"""The GPU check's ``continuous`` stage: what continuous batching buys a ``TorchEngine`` on the
device, one workload run both ways on one engine (Qwen3-0.6B's shape, a peaked output layer).

- **sub-batches**, as the lock-step and async drivers feed an engine: the requests go in
  groups of ``max_rows``, and each group runs until its longest request is done while its
  finished rows sit idle;
- **continuous**, as the continuous driver feeds it: every request is waiting from the start
  and joins the running batch at the first step boundary with a free row.

The requests' lengths vary as turns do (``max_tokens`` drawn from a Beta(0.7, 2) share of
the plan's ``new_tokens``, at least 4). Each request draws with its own key, so both schedules
must sample the same tokens up to rounding in batched kernels (``SAME_SHARE``).

The pair runs ``REPEATS`` times, in alternating order, the prefix cache emptied before each
run. Figures per schedule and run: seconds, generated tokens/s, decode steps, mean rows per
step, and mean rows per step while requests were left to admit. For the last continuous run,
a least-squares line ``ms = a + b · rows`` through the times of its steps that admitted
nothing (a small ``b``: a step is bound by its fixed overhead, and fuller batches are nearly
free), and the mean time of the steps that admitted requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from trace_core.bench.gpu_shapes import peaked
from trace_core.policy.continuous import ContinuousBatch, Request
from trace_core.policy.engine import SamplingParams
from trace_core.policy.sampling import request_keys
from trace_core.policy.torch_engine import TorchEngine

SPEEDUP = 1.25
"""On a GPU: continuous tokens/s at least this many times the sub-batches' (median of the
repeats)."""
REPEATS = 3
"""Pairs of runs, each schedule run once per pair, the order alternating."""
SAME_SHARE = {"cpu": 0.9, "cuda": 0.5}
"""At least this share of requests sample the same tokens under both schedules. A request's
rows meet other rows in each schedule, and bf16 kernels round a row's logits differently in
another batch: on a GPU a draw near the edge between two tokens flips, and the request's rest
differs from there (the same keys in float32 on a CPU: all but a few)."""


def _run(
    engine: TorchEngine,
    requests: list[Request],
    group: int,
    sync: Callable[[], None],
) -> tuple[list[tuple[int, ...]], dict[str, Any], list[tuple[int, float, bool]]]:
    """The requests in groups of ``group`` (each group drains before the next joins); a
    group as large as the workload is the continuous schedule. Returns each request's tokens,
    the figures, and (rows in flight, seconds) of every step."""
    tokens: list[tuple[int, ...]] = [() for _ in requests]
    timed: list[tuple[int, float, bool]] = []
    busy: list[int] = []  # rows of the steps run while requests were left to admit
    steps = row_steps = 0
    sync()
    start = time.perf_counter()
    for first in range(0, len(requests), group):
        batch = ContinuousBatch(engine)
        for i in range(first, min(first + group, len(requests))):
            batch.add(requests[i], i)
        while batch.pending:
            rows, waiting, tick = batch.row_steps, len(batch.waiting), time.perf_counter()
            for i, completion in batch.step():
                tokens[i] = tuple(completion.token_ids)
            sync()
            admitted = len(batch.waiting) < waiting
            timed.append((batch.row_steps - rows, time.perf_counter() - tick, admitted))
            if waiting or first + group < len(requests):  # more requests than this step ran
                busy.append(batch.row_steps - rows)
        steps, row_steps = steps + batch.steps, row_steps + batch.row_steps
    seconds = time.perf_counter() - start
    generated = sum(len(t) for t in tokens)
    figures = {
        "seconds": seconds,
        "tokens": generated,
        "tokens_per_s": generated / seconds,
        "decode_steps": steps,
        "rows_per_step": row_steps / max(steps, 1),
        "rows_per_step_while_waiting": float(np.mean(busy or [0])),
    }
    return tokens, figures, timed


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Tokens before the first difference."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def step_line(timed: list[tuple[int, float, bool]]) -> dict[str, float]:
    """``ms = a + b · rows`` fitted (least squares) to the steps that ran rows and admitted
    none, and the mean milliseconds of the steps that admitted requests (their prefill and the
    KV's new layout included)."""
    plain = [(r, 1e3 * s) for r, s, admitted in timed if r > 0 and not admitted]
    admitting = [1e3 * s for _, s, admitted in timed if admitted]
    figures = {"admitting_steps": len(admitting), "admitting_ms": float(np.mean(admitting or [0]))}
    rows = np.array([r for r, _ in plain], dtype=float)
    ms = np.array([m for _, m in plain])
    if len(rows) < 2 or np.ptp(rows) == 0:
        return {**figures, "a_ms": float(np.median(ms)) if len(ms) else 0.0, "b_ms_per_row": 0.0}
    b, a = np.polyfit(rows, ms, 1)
    return {**figures, "a_ms": float(a), "b_ms_per_row": float(b), "rows_max": float(rows.max())}


def stage_continuous(plan: Any, stage: Any) -> None:
    """``gpu_check``'s stage (its ``Plan`` and ``Stage``; that module imports this one)."""
    import torch

    cuda = plan.device == "cuda"
    stage.threshold = (
        f"≥ {SAME_SHARE[plan.device]:.0%} of requests sample the same tokens both ways"
        + (f"; continuous ≥ {SPEEDUP}× the sub-batches' tokens/s" if cuda else "")
    )
    shape, max_rows = plan.parity_shape, plan.rows
    engine = TorchEngine(
        peaked(shape.model(0)), device=plan.device, max_batch=max_rows,
        cache_tokens=4 * max_rows * plan.prompt_tokens,
    )  # fmt: skip
    rng = np.random.default_rng(11)
    count = 4 * max_rows
    lengths = np.maximum(4, (plan.new_tokens * rng.beta(0.7, 2.0, size=count)).astype(int))
    prompts = rng.integers(4, shape.vocab, size=(count, plan.prompt_tokens)).tolist()
    keys = request_keys(list(range(count)), 1)
    requests = [
        Request(tuple(p), SamplingParams(max_tokens=int(n), stop_token_ids=()), k)
        for p, n, k in zip(prompts, lengths, keys, strict=True)
    ]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed_run(group: int) -> tuple[list[tuple[int, ...]], dict[str, Any], list[Any]]:
        engine.cache.clear()  # no run finds the prompts another one prefilled
        return _run(engine, requests, group, sync)

    _run(engine, requests[: max_rows // 4], max_rows, sync)  # warm-up: kernels, allocator
    ratios, runs = [], []
    for repeat in range(REPEATS):  # the order alternates: neither schedule always runs first
        first, second = (max_rows, count) if repeat % 2 == 0 else (count, max_rows)
        one, two = timed_run(first), timed_run(second)
        (chunked, sub, _), (flowing, cont, timed) = (one, two) if first == max_rows else (two, one)
        ratios.append(cont["tokens_per_s"] / sub["tokens_per_s"])
        runs.append({"sub_batches": sub, "continuous": cont, "speedup": ratios[-1]})
    same = sum(a == b for a, b in zip(chunked, flowing, strict=True)) / count
    pairs = zip(chunked, flowing, strict=True)
    agree = np.mean([_common(a, b) / max(len(a), 1) for a, b in pairs])
    ratio = float(np.median(ratios))
    stage.figures.update(
        requests=count, max_rows=max_rows, mean_max_tokens=float(lengths.mean()),
        speedup=ratio, speedup_range=[min(ratios), max(ratios)], repeats=runs,
        same_tokens_share=same, tokens_before_first_difference=float(agree),
        step_ms=step_line(timed),
    )  # fmt: skip
    if same < SAME_SHARE[plan.device]:
        stage.fail(f"{same:.1%} of requests sample the same tokens under both schedules")
    elif not cuda:
        stage.skip("a CPU decode step costs in proportion to its rows: no speed threshold")
    elif ratio < SPEEDUP:
        stage.fail(f"continuous {ratio:.2f}× the sub-batches' tokens/s")
