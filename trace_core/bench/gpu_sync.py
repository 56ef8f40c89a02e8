"""The GPU check's ``sync`` stage: the resident session's weight sync between two processes on one
device, as a trainer rank 0 and a ``TorchEngine`` actor run it (``policy.weight_sync``), with no
Ray: the trainer holds fp32 master weights of a Qwen3-1.7B-shaped model, casts them to bf16
bucket by bucket and broadcasts them; the engine refolds each layer as it arrives. Figures:
seconds per sync and GB/s of serving-dtype weights, per backend; then the engine must sample
(fixed seed: tokens and their logprobs) what a fresh engine built from the trainer's weights
samples (the sync delivered every tensor), and not what it sampled before the sync.

Backends (``policy.weight_sync.choose_backend``): on one GPU the session picks ``cuda-ipc``, and
the threshold is on it; ``gloo`` (staged through host memory on both sides, what CPUs and mixed
placements use) and ``nccl`` (the choice between GPUs of their own) run beside it for
comparison. NCCL refuses two ranks on one device, so on a one-GPU machine its figure is the error
it gave, which does not fail the stage.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import torch

from trace_core.bench.gpu_shapes import Shape

PROMPT = [5, 17, 99, 4, 250, 31, 7, 12]
DECODE_TOKENS = 16
SAME_LOGPROB = 1e-3
"""Largest |Δ logprob| between two decodes of the same weights on the same device."""
MEMBER_TIMEOUT_S = {"cuda-ipc": 300.0, "gloo": 300.0, "nccl": 90.0}
"""How long the parent waits for a backend's rounds (NCCL refusing a shared device may hang)."""


def stage_sync(plan: Any, stage: Any) -> None:
    """``gpu_check``'s stage (its ``Plan`` and ``Stage``; that module imports this one)."""
    from trace_core.policy.weight_sync import choose_backend, device_id

    cuda = plan.device == "cuda"
    stage.threshold = (
        "the session's backend for one GPU (cuda-ipc) ≥ 5 GB/s of bf16 weights into the engine; "
        "every backend that runs: the engine then samples what a "
        "fresh engine from the trainer's weights samples (tokens, logprobs within 1e-3), and not "
        "what it sampled before"
    )
    shape: Shape = plan.sync_shape
    chosen = choose_backend([device_id(plan.device)] * 2)  # a trainer and an engine on one device
    backends = (chosen, "gloo", "nccl") if cuda else (chosen,)
    stage.figures["session_backend"] = chosen
    for backend in backends:
        result = run_pair(shape, plan.device, backend, plan.sync_rounds)
        stage.figures[backend] = result
        if "error" in result:
            if backend != "nccl":
                stage.fail(f"{backend}: {result['error']}")
            continue
        if not result["tokens_match"]:
            stage.fail(
                f"{backend}: the synced engine samples other tokens or logprobs than the trainer"
            )
        elif not result["tokens_changed"]:
            stage.fail(f"{backend}: the engine's decode did not change with the sync")
        elif cuda and backend == chosen and result["gb_per_s"] < 5.0:
            stage.fail(f"{backend}: {result['gb_per_s']:.2f} GB/s")
    best = stage.figures[chosen]
    if isinstance(best, dict) and "gb_per_s" in best:
        stage.figures.update(
            weights_gb=best["weights_gb"], sync_seconds=best["seconds"], gb_per_s=best["gb_per_s"]
        )
    if not cuda:
        stage.skip("no GB/s threshold on a CPU")


def run_pair(shape: Shape, device: str, backend: str, rounds: int) -> dict[str, Any]:
    """A trainer process and an engine process, ``rounds`` syncs: the median round's figures,
    or ``{"error": ...}`` with what went wrong in either."""
    from trace_core.policy.weight_sync import open_store

    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    store = open_store("127.0.0.1", 3, timeout_s=MEMBER_TIMEOUT_S[backend])
    members = [
        context.Process(
            target=member,
            args=(rank, int(store.port), shape, device, backend, rounds, results),
            daemon=True,
        )
        for rank in (0, 1)
    ]
    for process in members:
        process.start()
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + MEMBER_TIMEOUT_S[backend] + 120.0  # model builds included
    try:
        while len(got) < 2:
            try:
                rank, body = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(members) if r not in got and not p.is_alive()]
                if dead:  # a member that exits without a word (it could not even start)
                    code = members[dead[0]].exitcode
                    return {"error": f"rank {dead[0]} exited with status {code} and no figures"}
                if time.monotonic() > deadline:
                    return {"error": f"no answer within {MEMBER_TIMEOUT_S[backend]:.0f} s"}
                continue
            got[rank] = body
            if "error" in body:
                return {"error": f"rank {rank}: {body['error']}"}
    finally:
        for process in members:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    trainer, engine = got[0], got[1]
    seconds = _median(engine["seconds"])
    return {
        "weights_gb": trainer["nbytes"] / 1e9,
        "buckets": trainer["buckets"],
        "rounds": rounds,
        "seconds": seconds,
        "gb_per_s": trainer["nbytes"] / seconds / 1e9,
        "send_seconds": _median(trainer["seconds"]),
        "tokens_match": same_decode(engine["after"], trainer["tokens"], SAME_LOGPROB),
        "tokens_changed": not same_decode(engine["after"], engine["before"], SAME_LOGPROB),
    }


def member(
    rank: int, port: int, shape: Shape, device: str, backend: str, rounds: int, results: Any
) -> None:
    """Rank 0: the trainer (fp32 master weights, seed 0). Rank 1: a TorchEngine booted on other
    weights (seed 1). Each puts ``(rank, figures)`` or ``(rank, {"error": ...})``."""
    try:
        results.put((rank, _member(rank, port, shape, device, backend, rounds)))
    except Exception as err:  # reported to the parent, which fails the stage with it
        results.put((rank, {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}))


def _member(
    rank: int, port: int, shape: Shape, device: str, backend: str, rounds: int
) -> dict[str, Any]:
    from trace_core.policy.engine import SamplingParams
    from trace_core.policy.torch_engine import TorchEngine
    from trace_core.policy.weight_sync import (
        apply_weights,
        send_weights,
        staging_device,
        sync_group,
        weight_plan,
    )

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    if device == "cuda":
        torch.cuda.set_device(0)
    staging = staging_device(backend, device)  # gloo is staged through host memory
    model = shape.model(rank)
    plan = weight_plan(model, torch.bfloat16)
    sampling = SamplingParams(max_tokens=DECODE_TOKENS)
    group = sync_group("127.0.0.1", port, rank, 2, backend, MEMBER_TIMEOUT_S[backend])
    mark = torch.zeros(1, device=staging)
    seconds: list[float] = []
    if rank == 0:
        model = model.to(device)  # the fp32 master weights
        for _ in range(rounds):
            group.broadcast(mark, 0).wait()  # both sides start together
            start = time.perf_counter()
            send_weights(model, plan, group, staging)
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
        # What the engine should now serve: the master weights rounded to bf16 (on CPU the
        # engine keeps the dtype it booted in, fp32, holding the bf16-rounded values).
        rounded = model.to(torch.bfloat16)
        rounded = rounded.float() if device == "cpu" else rounded
        reference = TorchEngine(rounded, device=device, max_batch=1, cache_tokens=64)
        tokens = _sample(reference, sampling)
        return {"seconds": seconds, "nbytes": plan.nbytes, "buckets": len(plan.buckets),
                "tokens": tokens}  # fmt: skip
    engine = TorchEngine(model, device=device, max_batch=1, cache_tokens=64)
    del model
    before = _sample(engine, sampling)
    for _ in range(rounds):
        group.broadcast(mark, 0).wait()
        start = time.perf_counter()
        apply_weights(plan, group, engine.weight_sink(), staging)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "before": before, "after": _sample(engine, sampling)}


def _sample(engine: Any, params: Any) -> dict[str, list[Any]]:
    """Tokens sampled at a fixed seed and their logprobs: what these weights decode."""
    [[completion]] = engine.generate([PROMPT], params, seed=0)
    return {
        "tokens": [int(t) for t in completion.token_ids],
        "logprobs": [float(x) for x in completion.logprobs],
    }


def same_decode(a: dict[str, list[Any]], b: dict[str, list[Any]], tolerance: float) -> bool:
    if a["tokens"] != b["tokens"]:
        return False
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)),
               default=0.0) <= tolerance  # fmt: skip


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
