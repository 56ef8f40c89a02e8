"""``trace-rl bench workers``: rollout throughput with 1 and 2 Ray engine workers, of one
engine kind or several (``--engines torch,vllm``: vLLM against the TorchEngine).

One workload, run once per worker count and driver: ``grow_trees`` with strategy ``trace`` on
the calc task, a fixed pool and budget, a constant predictor, through a ``RayEnginePool`` whose
workers run one torch thread each. An in-process ``TorchEngine`` on one thread runs it too,
as the reference without Ray. Tokens/s = generated tokens / wall seconds of ``grow_trees``;
actor start-up and a warm-up run are not timed, and every timed run starts from empty prefix
caches. All engines are up at once and their runs interleave; the best of ``repeats`` runs
of each counts, and the machine's load average is recorded (the machine may be shared).

    from trace_core.bench.workers import WorkersBenchConfig, run_workers_bench
    print(run_workers_bench(WorkersBenchConfig(Path("build/policy/calc"))).ratio)

Each pool is timed with every driver of ``grow_trees`` (``EngineConfig.driver``): lock-step
(labels ``torch ray×2``), async (``torch ray×2 async``) and continuous (``torch ray×2
continuous``: each turn joins its engine's running batch); ``ratios()`` has async over
lock-step and continuous over async at every worker count.

``rows_in_flight`` is the mean number of rows an engine decodes per step (all workers'
steps together; TorchEngine's decode steps, vLLM's steps on the continuous driver), and
``rows_p95`` their 95th percentile: what batching buys on a GPU, where a step costs about the
same at 32 rows as at 256 (``docs/gpu``). ``idle_share`` is 1 - ``busy_share``.

``busy_share`` is the engines' busy time over (wall time × workers); the rest is what the
schedule leaves idle. Lock-step, ``grow_trees`` makes one engine call per turn-step and waits
for all of it, so within a call a worker that finishes its share early waits for the slowest
one (``imbalance_share``), and between calls every worker waits while the driver steps the
envs and Ray carries prompts and completions (the remainder). Async, a worker waits only for
turns to be freed: for the driver to step the envs of the sub-batch it just returned.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from trace_core.algo.metrics import measure
from trace_core.algo.plan import Budget
from trace_core.envs.base import Env, Step, Task
from trace_core.envs.suites import make_suite
from trace_core.policy.engine import Engine, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import load_checkpoint
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.engine_config import DRIVERS
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor
from trace_core.rollout.ray_pool import Driver, RayEnginePool, ray_session


@dataclass(frozen=True)
class WorkersBenchConfig:
    checkpoint: Path
    """Policy directory (HF format); a warm-started calc policy gives realistic turn lengths."""
    prompts: int = 256
    """Candidate prompts in the pool (calc train split, seeded)."""
    roots: int = 256
    """M: root rollouts."""
    continuations: int = 2
    """N: continuations per root."""
    max_tokens: int = 48
    """Generated tokens per turn at most."""
    seed: int = 0
    repeats: int = 3
    """Timed runs per engine; the best counts."""
    workers: tuple[int, ...] = (1, 2)
    """Worker counts to time; the ratio is the last over the first."""
    engines: tuple[str, ...] = ("torch",)
    """Engine kinds of the Ray workers (torch, hf, vllm), each timed at every worker count."""
    eager: bool = False
    """vLLM: no torch.compile or CUDA graphs (starts faster, decodes slower on GPU)."""
    kv_cache_gib: float = 0.0
    """vLLM: KV cache per engine in GiB (0: vLLM's default, 4 GiB on CPU)."""
    cache_tokens: int = 65_536
    """TorchEngine: prefix-cache slots per engine (``EngineConfig.cache_tokens``). Each slot
    holds a token's keys and values in every layer: at SmolLM2's 45 KB a token in fp32, the
    default is ≈ 3 GB per engine, and the bench starts 1 + 1 + 2 of them."""
    drivers: tuple[str, ...] = ("lock-step", "async", "continuous")
    """How ``grow_trees`` drives each pool (``EngineConfig.driver``), each timed."""
    env_seconds: float = 0.0
    """Every env step also waits this long, as a tool with latency does (a search API, a code
    sandbox); calc's own steps take microseconds."""

    def __post_init__(self) -> None:
        if min(self.prompts, self.max_tokens, self.repeats) < 1:
            raise ValueError("prompts, max_tokens and repeats must be >= 1")
        if self.cache_tokens < 2:
            raise ValueError(f"cache_tokens must be >= 2, got {self.cache_tokens}")
        if len(set(self.workers)) < 2 or min(self.workers) < 1:
            raise ValueError(
                f"workers must be two or more worker counts >= 1 (the ratio compares the most "
                f"with the fewest), got {self.workers}"
            )
        Budget(self.roots, self.continuations)  # validates roots and continuations
        if not self.env_seconds >= 0:
            raise ValueError(f"env_seconds must be >= 0, got {self.env_seconds}")
        unknown = sorted(set(self.engines) - {"torch", "hf", "vllm"})
        if unknown or not self.engines:
            raise ValueError(f"engines must be among torch, hf, vllm; got {self.engines}")
        if not self.drivers or set(self.drivers) - set(DRIVERS):
            raise ValueError(f"drivers must be among {', '.join(DRIVERS)}; got {self.drivers}")
        if "continuous" in self.drivers and "hf" in self.engines:
            raise ValueError(
                "drivers: continuous needs a running batch, which engine hf has not "
                "(drivers lock-step,async for it)"
            )


class SlowTool:
    """An env whose every step also waits ``seconds`` (the driver's thread sleeps, as it would
    waiting for a remote tool)."""

    def __init__(self, env: Env, seconds: float) -> None:
        self.env, self.seconds, self.max_turns = env, seconds, env.max_turns

    def reset(self, task: Task) -> str:
        return self.env.reset(task)

    def step(self, action: str) -> Step:
        time.sleep(self.seconds)
        return self.env.step(action)


@dataclass(frozen=True)
class WorkersRun:
    engine: str
    """``in-process``, or ``KIND ray×W`` (``torch ray×2``, ``vllm ray×1``) driven lock-step,
    ``KIND ray×W async`` and ``KIND ray×W continuous`` driven by those drivers."""
    workers: int
    """0 for the in-process engine."""
    seconds: float
    generated_tokens: int
    tokens_per_s: float
    engine_calls: int
    busy_share: float
    """Engine busy seconds / (wall seconds × workers)."""
    imbalance_share: float
    """Lock-step: worker seconds spent waiting for the slowest sub-batch of a call /
    (wall × workers); the rest of the idle time (1 - busy - imbalance) is the driver's turn
    (env steps, routing) and Ray's transport, when every worker waits. 0 for async."""
    prefill_tokens: int
    affinity_moved: int
    """Prompts routed away from the worker that held their prefix."""
    units: float
    rows_in_flight: float = 0.0
    """Mean rows per decode step of an engine (0 where the engine does not count them)."""
    rows_p95: float = 0.0
    """The 95th percentile of rows per decode step, over every engine's steps."""
    idle_share: float = 0.0
    """1 - ``busy_share``: the share of the engines' time the schedule left them idle."""


@dataclass(frozen=True)
class WorkersBenchResult:
    config: dict[str, object]
    runs: list[WorkersRun] = field(default_factory=list)
    load_average: tuple[float, float] = (0.0, 0.0)
    """The machine's 1-minute load average before and after: other work skews the timings."""
    cpus: int = 0

    @property
    def ratio(self) -> float:
        """Tokens/s of the most workers over the fewest, of the first engine kind and driver."""
        ray_runs = [r for r in self.runs if r.workers]
        driver = _driver(ray_runs[0].engine)
        first = [
            r
            for r in ray_runs
            if r.engine.startswith(self.kinds[0]) and _driver(r.engine) == driver
        ]
        return first[-1].tokens_per_s / first[0].tokens_per_s

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(r.engine.split()[0] for r in self.runs if r.workers))

    def ratios(self) -> dict[str, float]:
        """Every kind's most-over-fewest workers, and every kind over the first kind at each
        worker count: ``vllm ray×2 / torch ray×2``."""
        speed = {r.engine: r.tokens_per_s for r in self.runs if r.workers}
        counts = sorted({r.workers for r in self.runs if r.workers})
        suffixes = ("", " async", " continuous")
        drivers = [d for d in suffixes if any(e.endswith(f"×{counts[0]}{d}") for e in speed)]
        out = {}
        for d in drivers:
            for kind in self.kinds:
                most, fewest = f"{kind} ray×{counts[-1]}{d}", f"{kind} ray×{counts[0]}{d}"
                out[f"{most} / {fewest}"] = speed[most] / speed[fewest]
        for d in drivers:
            for kind in self.kinds[1:]:
                for w in counts:
                    base = f"{self.kinds[0]} ray×{w}{d}"
                    out[f"{kind} ray×{w}{d} / {base}"] = speed[f"{kind} ray×{w}{d}"] / speed[base]
        for later, earlier in (" async", ""), (" continuous", " async"):  # same pool
            if later in drivers and earlier in drivers:
                for kind in self.kinds:
                    for w in counts:
                        new, old = f"{kind} ray×{w}{later}", f"{kind} ray×{w}{earlier}"
                        out[f"{new} / {old}"] = speed[new] / speed[old]
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "config": self.config,
            "runs": [asdict(r) for r in self.runs],
            "ratio": self.ratio,
            "ratios": self.ratios(),
            "load_average": list(self.load_average),
            "cpus": self.cpus,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def percentile(counts: Counter[int], q: float) -> float:
    """The ``q`` quantile of values given as value -> how often (0 for none)."""
    total = sum(counts.values())
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q * total:
            return float(value)
    return 0.0


def _driver(label: str) -> str:
    """The driver a run's label names (``torch ray×2 async`` -> async)."""
    last = label.split()[-1]
    return last if last in ("async", "continuous") else "lock-step"


def run_workers_bench(
    config: WorkersBenchConfig, progress: Callable[[str], None] | None = None
) -> WorkersBenchResult:
    """Time the workload in process and with each worker count (see the module docstring)."""
    say = progress or (lambda _: None)
    suite = make_suite("calc", None, config.seed)
    tasks = suite.tasks("train")
    order = np.random.default_rng(config.seed).permutation(len(tasks))[: config.prompts]
    pool = [tasks[i] for i in order]
    model, tokenizer = load_checkpoint(config.checkpoint)
    fmt = TurnFormat(tokenizer)

    def make_env() -> Env:
        env = suite.make_env()
        return SlowTool(env, config.env_seconds) if config.env_seconds else env

    grow = GrowConfig(
        "trace",
        Budget(config.roots, config.continuations),
        SamplingParams(max_tokens=config.max_tokens),
        seed=config.seed,
    )

    def ready(ray_pool: RayEnginePool, driver: Driver) -> None:
        """Drive the pool with ``driver``, from empty prefix caches."""
        ray_pool.driver = driver
        ray_pool.update_weights(config.checkpoint)

    def timed(engine: Engine, reset: Callable[[], None], label: str, workers: int) -> WorkersRun:
        reset()  # every timed run starts from empty prefix caches (and a pool, its driver)
        before = (engine.stats.calls, engine.stats.prefill_tokens, dict(engine.stats.extra))
        counts = Counter(getattr(engine, "row_counts", {}))
        start = time.perf_counter()
        trees = grow_trees(engine, fmt, make_env, pool, ConstantPredictor(), grow)
        seconds = time.perf_counter() - start
        extra = engine.stats.extra
        busy = extra.get("worker_seconds", 0.0) - before[2].get("worker_seconds", 0.0)
        moved = extra.get("affinity_moved", 0.0) - before[2].get("affinity_moved", 0.0)
        key = "imbalance_idle_seconds"
        imbalance = extra.get(key, 0.0) - before[2].get(key, 0.0)
        kind = "engine" if workers else "decode"  # a pool's counters, or the engine's own
        steps = extra.get(f"{kind}_steps", 0.0) - before[2].get(f"{kind}_steps", 0.0)
        rows = extra.get(f"{kind}_row_steps", 0.0) - before[2].get(f"{kind}_row_steps", 0.0)
        metrics = measure(trees)
        counts = Counter(getattr(engine, "row_counts", {})) - counts
        busy_share = busy / (seconds * workers) if workers else 1.0
        return WorkersRun(
            engine=label,
            workers=workers,
            seconds=seconds,
            generated_tokens=metrics.tokens,
            tokens_per_s=metrics.tokens / seconds,
            engine_calls=engine.stats.calls - before[0],
            busy_share=busy_share,
            imbalance_share=imbalance / (seconds * workers) if workers else 0.0,
            prefill_tokens=engine.stats.prefill_tokens - before[1],
            affinity_moved=int(moved),
            units=metrics.units,
            rows_in_flight=rows / steps if steps else 0.0,
            rows_p95=percentile(counts, 0.95),
            idle_share=1.0 - busy_share,
        )

    load_before = os.getloadavg()[0]
    threads = torch.get_num_threads()
    best: dict[str, WorkersRun] = {}
    # Every pool is up at once and the runs interleave, so a burst of other load on a shared
    # machine hits every engine alike instead of whichever ran at that moment.
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        torch.set_num_threads(1)  # the in-process engine, as one worker would run
        local = TorchEngine(model, cache_tokens=config.cache_tokens)
        engines: list[tuple[Engine, Callable[[], None], str, int]] = [
            (local, functools.partial(local.update_weights, model), "in-process", 0)
        ]
        stack.enter_context(ray_session(num_cpus=sum(config.workers) * len(config.engines)))
        for kind in config.engines:
            for w in config.workers:
                say(f"starting {w} Ray workers ({kind})")
                ray_pool = stack.enter_context(
                    RayEnginePool(
                        config.checkpoint,
                        workers=w,
                        threads_per_worker=1,
                        engine=kind,  # type: ignore[arg-type]  # checked by the config
                        eager=config.eager,
                        kv_cache_bytes=int(config.kv_cache_gib * 2**30) or None,
                        cache_tokens=config.cache_tokens,
                    )
                )
                for driver in config.drivers:
                    label = f"{kind} ray×{w}" + ("" if driver == "lock-step" else f" {driver}")
                    reset = functools.partial(ready, ray_pool, driver)
                    engines.append((ray_pool, reset, label, w))
        for engine, reset, label, _ in engines:
            say(f"{label}: warm-up")
            reset()
            grow_trees(engine, fmt, make_env, pool, ConstantPredictor(), grow)
        for r in range(config.repeats):
            for engine, clear, label, w in engines:
                say(f"{label}: run {r + 1}/{config.repeats}")
                run = timed(engine, clear, label, w)
                if label not in best or run.tokens_per_s > best[label].tokens_per_s:
                    best[label] = run
    return WorkersBenchResult(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        runs=list(best.values()),
        load_average=(load_before, os.getloadavg()[0]),
        cpus=os.cpu_count() or 0,
    )
