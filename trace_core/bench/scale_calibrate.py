"""``trace-rl bench scale-calibrate``: fit the simulator's CPU cost model on this machine.

Everything runs on the policy in ``checkpoint`` with one torch thread, as every
``bench workers`` worker does:

* **Synthetic calls** (``bench engine``-style): ``TorchEngine`` on ``batches × lengths``
  random prompts (equal lengths, and lengths mixed from a quarter of it up, which pads),
  from an empty prefix cache with ``max_tokens=1`` and with ``new_tokens`` (no stop token:
  every row runs every step), then ``max_tokens=1`` again with every prompt cached; the best
  of ``repeats``.
* **Rollout calls.** Every engine call of the ``bench workers`` workload grown in process
  with another seed (``seed + 1``: other prompts of the suite and other samples than the
  run it will predict),
  timed one by one, with its rows' prompt, prefilled and generated tokens. Rows that stop
  early are what the synthetic calls lack; ``--no-real-calls`` fits without them.
* **Fit.** A call's seconds are linear in the cost model's engine coefficients
  (``scale_sim.batch_features``); least squares on relative error, coefficients >= 0.
* **Driver.** The same grow's wall time less its calls and its env steps, per turn
  (``driver_turn_s``: decoding actions, tokenising replies, recording nodes, stage 2).
* **Transport.** A one-worker ``RayEnginePool``: 1-token calls on the trees' own prompts;
  the wall time less the worker's busy time, on few and on many prompts, fitted as
  ``transport_s`` + ``route_token_s`` per prompt token.
* **Trees.** The ``bench workers`` workload itself (its seed) grown once more and written to
  ``trees``: the iteration ``bench scale --trees`` replays.

    config = CalibrationConfig(Path("build/policy/calc"), Path("build/scale/trees.parquet"))
    profile, trees = calibrate(config)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from trace_core.algo.plan import Budget
from trace_core.algo.tree import RolloutTree
from trace_core.bench.scale import Profile
from trace_core.bench.scale_sim import COEFFICIENTS, CostModel, batch_features
from trace_core.bench.scale_trace import time_env_steps, turn_stream
from trace_core.bench.workers import WorkersBenchConfig
from trace_core.envs.suites import make_suite
from trace_core.policy.engine import Completion, Engine, EngineStats, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import load_checkpoint
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor
from trace_core.rollout.ray_pool import RayEnginePool
from trace_core.store.schema import write_trees


@dataclass(frozen=True)
class CalibrationConfig:
    checkpoint: Path
    """Policy directory (HF format): the one ``bench workers`` will time."""
    trees: Path
    """Where the workload's trees are written (Parquet)."""
    workload: WorkersBenchConfig | None = None
    """The ``bench workers`` workload (None: its defaults on ``checkpoint``)."""
    batches: tuple[int, ...] = (1, 4, 16, 64)
    lengths: tuple[int, ...] = (32, 160)
    new_tokens: int = 24
    repeats: int = 2
    real_calls: bool = True
    """Fit on the rollout calls too, not only the synthetic ones."""
    transport: bool = True
    """Time the Ray round trip (starts an in-process Ray); off: transport costs are 0."""

    def __post_init__(self) -> None:
        if min(*self.batches, *self.lengths, self.repeats) < 1 or self.new_tokens < 2:
            raise ValueError("batches, lengths and repeats must be >= 1, new_tokens >= 2")
        if len(self.batches) < 2 or len(self.lengths) < 2:
            raise ValueError("the fit needs at least two batch sizes and two prompt lengths")


@dataclass(frozen=True)
class CallTiming:
    kind: str
    """``fresh``, ``decode``, ``cached`` (synthetic) or ``rollout``."""
    rows: int
    prompt_tokens: int
    prefill_tokens: int
    generated_tokens: int
    seconds: float
    features: list[float]
    """``scale_sim.batch_features`` of the call."""


class _TimedEngine:
    """An ``Engine`` that records every call of the engine it wraps as a ``CallTiming``."""

    def __init__(self, engine: TorchEngine, max_batch: int) -> None:
        self.engine, self.max_batch = engine, max_batch
        self.stats: EngineStats = engine.stats  # the same counters, updated by the engine
        self.calls: list[CallTiming] = []

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        before = self.engine.stats.prefill_tokens
        start = time.perf_counter()
        out = self.engine.generate(prompts, params, seed=seed)
        seconds = time.perf_counter() - start
        prompt = np.array([len(p) for p in prompts], dtype=np.int64)
        gen = np.array([len(c.token_ids) for cs in out for c in cs], dtype=np.int64)
        filled = self.engine.stats.prefill_tokens - before
        # The engine counts prefill per call; spread it over the rows by their length.
        prefill = np.minimum(np.rint(prompt * filled / max(prompt.sum(), 1)), prompt)
        prefill = prefill.astype(np.int64)
        self.calls.append(_timing("rollout", prefill, prompt - prefill, gen, seconds, self))
        return out


def _timing(
    kind: str,
    prefill: npt.NDArray[np.int64],
    cached: npt.NDArray[np.int64],
    gen: npt.NDArray[np.int64],
    seconds: float,
    engine: _TimedEngine | TorchEngine,
) -> CallTiming:
    features = batch_features(prefill, cached, gen, engine.max_batch, continuous=False)
    return CallTiming(
        kind, len(gen), int((prefill + cached).sum()), int(prefill.sum()), int(gen.sum()),
        seconds, features.tolist(),
    )  # fmt: skip


def calibrate(
    config: CalibrationConfig, progress: Callable[[str], None] | None = None
) -> tuple[Profile, list[RolloutTree]]:
    """The fitted CPU profile and the workload's trees (written to ``config.trees``)."""
    say = progress or (lambda _: None)
    workload = config.workload or WorkersBenchConfig(config.checkpoint)
    model, tokenizer = load_checkpoint(config.checkpoint)
    fmt = TurnFormat(tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = TorchEngine(model)
        say("timing synthetic calls")
        calls = time_synthetic_calls(engine, len(tokenizer), config)
        say("timing a rollout's calls (another seed)")
        grow_workload(engine, fmt, workload)  # warm-up
        engine.clear_cache()
        timed = _TimedEngine(engine, engine.max_batch)
        start = time.perf_counter()
        practice = grow_workload(timed, fmt, workload, seed=workload.seed + 1)
        wall = time.perf_counter() - start
        suite = make_suite("calc", None, workload.seed)
        stream = time_env_steps(turn_stream(practice), practice, suite)
        engine_s = sum(c.seconds for c in timed.calls)
        driver_turn = max(wall - engine_s - float(stream.env_seconds.sum()), 0.0) / stream.turns
        if config.real_calls:
            calls += timed.calls
        say("growing the workload's trees")
        engine.clear_cache()
        trees = grow_workload(engine, fmt, workload)
        config.trees.parent.mkdir(parents=True, exist_ok=True)
        write_trees(config.trees, trees)
        transport, per_token = 0.0, 0.0
        if config.transport:
            say("timing Ray round trips")
            transport, per_token = time_transport(config.checkpoint, trees)
    finally:
        torch.set_num_threads(threads)
    x = np.array([c.features for c in calls])
    coef = nonnegative_lstsq(x, np.array([c.seconds for c in calls]))
    cost = CostModel(
        **dict(zip(COEFFICIENTS, coef, strict=True)),
        max_batch=engine.max_batch,
        continuous=False,
        transport_s=transport,
        route_token_s=per_token,
        driver_turn_s=driver_turn,
    )
    profile = Profile(
        name=f"cpu-{config.checkpoint.name}",
        cost=cost,
        source=(
            f"measured on this machine by `trace-rl bench scale-calibrate` on {config.checkpoint}"
            f" (TorchEngine, one torch thread; {len(calls)} calls"
            + (", rollout calls included)" if config.real_calls else ", synthetic only)")
        ),
        measurements=[asdict(c) for c in calls],
    )
    return profile, trees


def grow_workload(
    engine: Engine, fmt: TurnFormat, w: WorkersBenchConfig, seed: int | None = None
) -> list[RolloutTree]:
    """``bench workers``' workload, grown once: same suite, pool, budget, sampling and seed;
    ``seed``: another pool and other samples from the same suite."""
    suite = make_suite("calc", None, w.seed)
    tasks = suite.tasks("train")
    s = w.seed if seed is None else seed
    order = np.random.default_rng(s).permutation(len(tasks))[: w.prompts]
    grow = GrowConfig(
        "trace", Budget(w.roots, w.continuations), SamplingParams(max_tokens=w.max_tokens), seed=s
    )
    pool = [tasks[i] for i in order]
    return grow_trees(engine, fmt, suite.make_env, pool, ConstantPredictor(), grow)


def time_synthetic_calls(
    engine: TorchEngine, vocab: int, config: CalibrationConfig
) -> list[CallTiming]:
    rng = np.random.default_rng(0)
    one = SamplingParams(n=1, temperature=1.0, max_tokens=1)
    full = SamplingParams(n=1, temperature=1.0, max_tokens=config.new_tokens)
    out = []
    for batch in config.batches:
        for length in config.lengths:
            for mixed in (False, True):
                sizes = rng.integers(length // 4, length + 1, batch) if mixed else [length] * batch
                prompts = [rng.integers(8, vocab, size=int(n)).tolist() for n in sizes]
                lens = np.array([len(p) for p in prompts], dtype=np.int64)
                ones, zeros = np.ones(batch, np.int64), np.zeros(batch, np.int64)
                shapes = {  # (params, clear the cache first, prefill, cached, generated)
                    "fresh": (one, True, lens, zeros, ones),
                    "decode": (full, True, lens, zeros, ones * config.new_tokens),
                    "cached": (one, False, ones, lens - 1, ones),  # a cached prompt reruns 1
                }
                best = dict.fromkeys(shapes, np.inf)
                for run in range(config.repeats + 1):  # run 0 warms up
                    for kind, (params, clear, *_) in shapes.items():
                        if clear:
                            engine.clear_cache()
                        start = time.perf_counter()
                        engine.generate(prompts, params, seed=run)
                        if run:
                            best[kind] = min(best[kind], time.perf_counter() - start)
                for kind, (_, _, prefill, cached, gen) in shapes.items():
                    out.append(_timing(kind, prefill, cached, gen, best[kind], engine))
    return out


def nonnegative_lstsq(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> list[float]:
    """Least squares on relative error (rows weighted by 1/y: a small call counts as much as
    a large one), refitted without any coefficient that comes out negative (set to 0)."""
    w = 1.0 / np.maximum(y, 1e-9)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [a for a, s in zip(active, sol, strict=True) if s >= 0]
    return [float(c) for c in coef]


def time_transport(
    checkpoint: Path, trees: list[RolloutTree], calls: int = 8
) -> tuple[float, float]:
    """(seconds per sub-batch, seconds per prompt token): Ray's round trip and the routing,
    from one-worker calls of 1-token generations on few and on many of the trees' prompts."""
    prompts = []
    for tree in trees:
        for v in range(1, tree.size):
            path = tree.path(v)[:-1]
            history = [int(x) for n in path for x in (*tree.gen_tokens[n], *tree.obs_tokens[n])]
            prompts.append(history)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=1)
    sizes = sorted({max(1, len(prompts) // 64), max(2, len(prompts) // 4)})
    rows = []
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(RayEnginePool(checkpoint, workers=1, threads_per_worker=1))
        pool.generate(prompts[:4], params, seed=0)  # warm-up
        for size in sizes:
            batch = prompts[:size]
            tokens = sum(len(p) for p in batch)
            best = float("inf")
            for call in range(calls):
                before = pool.stats.extra.get("worker_seconds", 0.0)
                start = time.perf_counter()
                pool.generate(batch, params, seed=call)
                wall = time.perf_counter() - start
                best = min(best, wall - (pool.stats.extra.get("worker_seconds", 0.0) - before))
            rows.append((float(tokens), max(best, 0.0)))
    (t0, s0), (t1, s1) = rows[0], rows[-1]
    per_token = max((s1 - s0) / (t1 - t0), 0.0) if t1 > t0 else 0.0
    return max(s0 - per_token * t0, 0.0), per_token
