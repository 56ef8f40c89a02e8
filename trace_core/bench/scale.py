"""``trace-rl bench scale``: one rollout iteration simulated on 1 to 256 engine workers.

The iteration is read from stored trees (``scale_trace``), its env steps timed in the task's
own env, and run through the discrete-event simulation (``scale_sim``) under every
scheduling variant at every worker count, with the service times of a ``Profile``:

* ``cpu-*``, fitted on this machine by ``bench scale-calibrate`` (a JSON file);
* built-in GPU profiles (``GPU_PROFILES``): a roofline from the GPU's published memory
  bandwidth and bf16 throughput and the model's published shape, at efficiencies chosen so
  that it meets public vLLM throughput figures. Public figures, not measured here; the
  sources are in docs/scaling.md.

``validate`` replays the same trees on the CPU profile at the worker counts of a
``bench workers --json`` file and compares the predicted tokens/s and busy share with what
that run measured.

    profile = load_profile("build/scale/cpu-profile.json")
    result = run_scale_bench(ScaleBenchConfig(tree_paths("build/scale/trees.parquet"), profile))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from trace_core.bench.scale_sim import BASELINE, VARIANTS, CostModel, SimResult, simulate
from trace_core.bench.scale_trace import TurnStream, resize_stream, time_env_steps, turn_stream
from trace_core.envs.suites import make_suite
from trace_core.store.schema import read_trees

DEFAULT_WORKERS = (1, 2, 8, 64, 256)


@dataclass(frozen=True)
class Profile:
    name: str
    cost: CostModel
    source: str
    """Where the numbers come from: measured here, or which public figures."""
    measurements: list[dict[str, object]] = field(default_factory=list)
    """The timings a measured profile was fitted to."""

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "cost": asdict(self.cost),
            "measurements": self.measurements,
        }

    @classmethod
    def from_json(cls, data: dict[str, object], where: str) -> Profile:
        try:
            cost = CostModel(**data["cost"])  # type: ignore[arg-type]
            timings = data.get("measurements", [])
            measurements = list(timings) if isinstance(timings, list) else []
            return cls(str(data["name"]), cost, str(data["source"]), measurements)
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: not a scale profile ({err}); write one with "
                             "`trace-rl bench scale-calibrate`") from None  # fmt: skip


@dataclass(frozen=True)
class GpuShape:
    """A model on a GPU, from published figures (docs/scaling.md cites each)."""

    params: float
    """Parameters (the weights every decode step reads)."""
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    bandwidth: float = 3.35e12
    """Bytes/s of HBM: H100 SXM (NVIDIA datasheet)."""
    flops: float = 989e12
    """Dense bf16 FLOP/s: H100 SXM (NVIDIA datasheet)."""


MEMORY_EFFICIENCY = 0.75
"""Share of the HBM bandwidth a decode step reaches (≈77% measured publicly for an 8B model
at batch 1 on an A100, docs/scaling.md)."""
COMPUTE_EFFICIENCY = 0.5
"""Share of the bf16 peak in decode's per-row matmuls and prefill: chosen so an 8B model at
256 rows meets the ≈12,500 tokens/s published for vLLM on one H100 (docs/scaling.md)."""
GPU_DRIVER = {"transport_s": 2e-3, "route_token_s": 2e-8, "driver_turn_s": 1e-4, "call_s": 5e-3}
"""Assumptions, not measured: Ray round trip, routing per token, driver per turn and vLLM's
per-call overhead on a GPU cluster (the CPU profile measures its own)."""


def gpu_profile(name: str, shape: GpuShape) -> Profile:
    """A roofline ``CostModel`` for ``shape`` under vLLM (continuous batching, bf16)."""
    weight_bytes = 2 * shape.params
    kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2  # K and V, bf16
    compute = shape.flops * COMPUTE_EFFICIENCY
    cost = CostModel(
        prefill_token_s=2 * shape.params / compute,
        prefill_attention_s=4 * shape.layers * shape.heads * shape.head_dim / compute,
        prompt_token_s=0.0,  # paged KV: a cached block is referenced, not copied
        decode_step_s=weight_bytes / (shape.bandwidth * MEMORY_EFFICIENCY),
        decode_row_s=2 * shape.params / compute,
        decode_context_s=kv_bytes / (shape.bandwidth * MEMORY_EFFICIENCY),
        max_batch=256,
        continuous=True,
        **GPU_DRIVER,  # type: ignore[arg-type]
    )
    source = (
        "public figures, not measured here: roofline of the H100 SXM datasheet (3.35 TB/s, "
        f"989 TFLOP/s bf16) at {MEMORY_EFFICIENCY:.0%} of bandwidth and {COMPUTE_EFFICIENCY:.0%}"
        " of compute, the Qwen3 model card's shape; driver costs assumed (docs/scaling.md)"
    )
    return Profile(name, cost, source)


QWEN3 = {
    "1.7b": GpuShape(params=1.7e9, layers=28, kv_heads=8, head_dim=128, heads=16),
    "8b": GpuShape(params=8.2e9, layers=36, kv_heads=8, head_dim=128, heads=32),
    "14b": GpuShape(params=14.8e9, layers=40, kv_heads=8, head_dim=128, heads=40),
}
"""Qwen3 shapes from the model cards on Hugging Face (parameters, layers, KV heads, head dim)."""
GPU_PROFILES = {
    f"h100-{size}-vllm": gpu_profile(f"h100-{size}-vllm", s) for size, s in QWEN3.items()
}


def load_profile(spec: str) -> Profile:
    """A built-in profile by name, or a JSON file ``bench scale-calibrate`` wrote."""
    if spec in GPU_PROFILES:
        return GPU_PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"--profile {spec!r}: neither a built-in profile ({', '.join(GPU_PROFILES)}) nor a "
            "file; write one with `trace-rl bench scale-calibrate --checkpoint DIR`"
        )
    return Profile.from_json(json.loads(path.read_text()), str(path))


@dataclass(frozen=True)
class ScaleBenchConfig:
    trees: tuple[Path, ...]
    """Parquet files of one iteration's trees."""
    profile: Profile
    workers: tuple[int, ...] = DEFAULT_WORKERS
    variants: tuple[str, ...] = tuple(v.name for v in VARIANTS)
    task: str | None = "calc"
    """Suite whose env replays the trees' actions to time the env steps; None: no env time."""
    suite_seed: int = 0
    """Seed of that suite (the trees' prompt ids name its tasks)."""
    env_seconds: float | None = None
    """Every env step takes this long instead (a slower tool than the task's own)."""
    copies: int = 1
    """Copies of the tree set: more prompts per iteration, for many workers."""
    token_scale: float = 1.0
    """Every token count × this: longer turns than the trees' policy wrote."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"--workers must be worker counts >= 1, got {self.workers}")
        known = [v.name for v in VARIANTS]
        if not self.variants or set(self.variants) - set(known):
            raise ValueError(f"--variants must be among {', '.join(known)}; got {self.variants}")
        if self.env_seconds is not None and self.env_seconds < 0:
            raise ValueError(f"--env-seconds must be >= 0, got {self.env_seconds}")


@dataclass(frozen=True)
class Validation:
    run: str
    """The measured run: ``in-process``, ``torch ray×W`` or ``torch ray×W async``."""
    workers: int
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    measured_busy: float
    predicted_busy: float

    @property
    def error(self) -> float:
        """Predicted over measured tokens/s, less 1."""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1


@dataclass(frozen=True)
class ScaleBenchResult:
    config: dict[str, object]
    stream: dict[str, float]
    runs: list[SimResult]
    validation: list[Validation] = field(default_factory=list)

    def run(self, variant: str, workers: int) -> SimResult:
        return next(r for r in self.runs if r.variant == variant and r.workers == workers)

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per run: makespan over the baseline's (``trace``) and over ``grpo``'s at the same
        W (when they ran), and tokens/s over its own at the fewest workers."""
        names = {r.variant for r in self.runs}
        fewest = min(r.workers for r in self.runs)
        out = {}
        for r in self.runs:
            key = f"{r.variant} W={r.workers}"
            out[key] = {"speedup": r.tokens_per_s / self.run(r.variant, fewest).tokens_per_s}
            for base in (BASELINE, "grpo"):
                if base in names:
                    out[key][f"vs_{base}"] = r.makespan_s / self.run(base, r.workers).makespan_s
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "config": self.config,
            "stream": self.stream,
            "runs": [asdict(r) for r in self.runs],
            "ratios": self.ratios(),
            "validation": [{**asdict(v), "error": v.error} for v in self.validation],
        }


def load_stream(config: ScaleBenchConfig) -> TurnStream:
    trees = [tree for path in config.trees for tree in read_trees(path)]
    if not trees:
        raise ValueError(f"--trees: no trees in {', '.join(map(str, config.trees))}")
    stream = turn_stream(trees)
    if config.env_seconds is not None:
        stream = replace(stream, env_seconds=stream.env_seconds * 0 + config.env_seconds)
    elif config.task is not None:
        stream = time_env_steps(stream, trees, make_suite(config.task, None, config.suite_seed))
    return resize_stream(stream, config.copies, config.token_scale)


def run_scale_bench(
    config: ScaleBenchConfig, measured: dict[str, object] | None = None
) -> ScaleBenchResult:
    """Every variant at every worker count; ``measured``: a ``bench workers`` JSON to check
    the prediction against (the CPU profile's)."""
    stream = load_stream(config)
    by_name = {v.name: v for v in VARIANTS}
    runs = [
        simulate(stream, by_name[name], w, config.profile.cost, config.seed)
        for name in config.variants
        for w in config.workers
    ]
    checks = validate(stream, config.profile.cost, measured) if measured else []
    return ScaleBenchResult(
        config={
            "trees": [str(p) for p in config.trees],
            "profile": config.profile.to_json(),
            "workers": list(config.workers),
            "variants": list(config.variants),
            "task": config.task,
            "env_seconds": config.env_seconds,
            "copies": config.copies,
            "token_scale": config.token_scale,
            "seed": config.seed,
        },
        stream=stream.summary(),
        runs=runs,
        validation=checks,
    )


def validate(stream: TurnStream, cost: CostModel, measured: dict[str, object]) -> list[Validation]:
    """The schedule predicted for every run of a ``bench workers`` result: the Ray runs at
    their worker counts (``trace-async`` for the async driver's, ``trace-continuous`` for the
    continuous driver's, the baseline for lock-step's),
    the in-process engine as one worker with no transport."""
    runs = measured.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError("--measured: not a `trace-rl bench workers --json` file (no runs)")
    by_name = {v.name: v for v in VARIANTS}
    out = []
    for run in runs:
        label, workers = str(run["engine"]), int(run["workers"])
        if workers and not label.startswith("torch"):
            continue  # the profile is TorchEngine's
        model = cost if workers else replace(cost, transport_s=0.0, route_token_s=0.0)
        driver = label.split()[-1]
        variant = by_name[
            {"async": "trace-async", "continuous": "trace-continuous"}.get(driver, BASELINE)
        ]
        sim = simulate(stream, variant, max(workers, 1), model)
        out.append(
            Validation(
                run=label,
                workers=workers,
                measured_tokens_per_s=float(run["tokens_per_s"]),
                predicted_tokens_per_s=sim.tokens_per_s,
                measured_busy=float(run["busy_share"]),
                predicted_busy=sim.utilisation,
            )
        )
    return out
