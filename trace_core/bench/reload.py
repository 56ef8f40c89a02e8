"""``trace-rl bench reload``: a new policy into running engine actors, against starting them
afresh, per engine kind.

A training run hands its engines a new checkpoint every iteration. Started afresh, a Ray engine
actor pays for its process, imports, the load and (vLLM) the engine's start; kept, it only
loads the weights (``RayEnginePool.update_weights``: vLLM's in-place reload, the TorchEngine's
``update_weights``). Both are timed on the same checkpoints, alternating between the given one
and a copy with every weight scaled by ``1 + 1e-3`` (new weights, same architecture):

    fresh   = RayEnginePool(checkpoint, workers=1, engine=kind) until its actor is ready
    reload  = pool.update_weights(other checkpoint)

The best of ``repeats`` of each counts; the ratio is fresh / reload (how many reloads fit in
one fresh start).

    from trace_core.bench.reload import ReloadBenchConfig, run_reload_bench
    print(run_reload_bench(ReloadBenchConfig(Path("build/models/smollm2"))).ratios)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trace_core.policy.model import load_checkpoint, save_checkpoint
from trace_core.rollout.ray_pool import RayEnginePool, ray_session


@dataclass(frozen=True)
class ReloadBenchConfig:
    checkpoint: Path
    """Policy directory (HF format)."""
    engines: tuple[str, ...] = ("torch",)
    """Engine kinds timed: torch, hf, vllm."""
    repeats: int = 3
    """Fresh starts and reloads timed per kind; the best of each counts."""
    eager: bool = False
    """vLLM: no torch.compile or CUDA graphs."""
    kv_cache_gib: float = 0.0
    """vLLM: KV cache in GiB (0: vLLM's default)."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        unknown = sorted(set(self.engines) - {"torch", "hf", "vllm"})
        if unknown or not self.engines:
            raise ValueError(f"engines must be among torch, hf, vllm; got {self.engines}")


@dataclass(frozen=True)
class ReloadRun:
    engine: str
    fresh_seconds: float
    """Best time from the pool's constructor to its actor answering."""
    reload_seconds: float
    """Best ``update_weights`` of the running actor."""

    @property
    def ratio(self) -> float:
        return self.fresh_seconds / self.reload_seconds


@dataclass(frozen=True)
class ReloadBenchResult:
    config: dict[str, object]
    runs: list[ReloadRun] = field(default_factory=list)

    @property
    def ratios(self) -> dict[str, float]:
        return {r.engine: r.ratio for r in self.runs}

    def to_json(self) -> dict[str, object]:
        return {
            "config": self.config,
            "runs": [{**asdict(r), "ratio": r.ratio} for r in self.runs],
            "ratios": self.ratios,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def run_reload_bench(
    config: ReloadBenchConfig, progress: Callable[[str], None] | None = None
) -> ReloadBenchResult:
    say = progress or (lambda _: None)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as scratch, ray_session(num_cpus=2):
        other = Path(scratch, "other")
        model, tokenizer = load_checkpoint(config.checkpoint)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-3)
        save_checkpoint(model, tokenizer, other)
        del model
        for kind in config.engines:
            options = {
                "workers": 1,
                "engine": kind,
                "eager": config.eager,
                "kv_cache_bytes": int(config.kv_cache_gib * 2**30) or None,
            }
            fresh, reload = [], []
            for r in range(config.repeats):
                say(f"{kind}: fresh start {r + 1}/{config.repeats}")
                start = time.perf_counter()
                pool = RayEnginePool(config.checkpoint, **options)  # type: ignore[arg-type]
                fresh.append(time.perf_counter() - start)
                with pool:
                    say(f"{kind}: reload {r + 1}/{config.repeats}")
                    reload.append(pool.update_weights(other if r % 2 == 0 else config.checkpoint))
                    reload.append(pool.update_weights(config.checkpoint if r % 2 == 0 else other))
            runs.append(ReloadRun(kind, min(fresh), min(reload)))
    return ReloadBenchResult(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}
        | {"cpus": os.cpu_count() or 0},
        runs=runs,
    )
