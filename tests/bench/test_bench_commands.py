"""The benchmarks: ``run_allocation_bench`` in process, then the real ``trace-rl`` CLI, tiny.

Nothing here asserts on how long anything took: timings only have to be present and finite.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_core.algo.plan import STRATEGIES
from trace_core.bench.allocation import (
    METRICS,
    AllocationBenchConfig,
    run_allocation_bench,
)
from trace_core.bench.allocator_speed import run_allocator_speed
from trace_core.bench.parsing import hostile
from trace_core.envs.sim.world import SimConfig

METRIC_KEYS = {
    "prompt_effective_ratio",
    "anchor_effective_ratio",
    "mixed_per_100_units",
    "contrast_pairs",
    "units",
    "tokens",
}
CONFIG_KEYS = {
    "prompts",
    "budget",
    "continuations",
    "group",
    "sim",
    "seeds",
    "iterations",
    "strategies",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_allocation_json(data: dict[str, object], strategies: list[str]) -> None:
    """{"config": {...}, "strategies": {name: {metric: {"mean": x, "std": y}}}}, exactly."""
    assert set(data) == {"config", "strategies"}
    config, results = data["config"], data["strategies"]
    assert isinstance(config, dict) and set(config) == CONFIG_KEYS
    assert isinstance(results, dict) and list(results) == strategies
    for name, metrics in results.items():
        assert set(metrics) == METRIC_KEYS, name
        for metric, summary in metrics.items():
            assert set(summary) == {"mean", "std"}, (name, metric)
            assert all(isinstance(x, float) and math.isfinite(x) for x in summary.values())
            assert summary["std"] >= 0


# --- in process --------------------------------------------------------------------------
TINY = AllocationBenchConfig(prompts=64, budget=32, seeds=2, iterations=2)


def test_metrics_are_the_documented_ones() -> None:
    assert set(METRICS) == METRIC_KEYS and len(METRICS) == len(METRIC_KEYS)


def test_allocation_bench_at_a_tiny_size() -> None:
    progress: list[str] = []
    result = run_allocation_bench(TINY, progress=progress.append)
    # One progress tick per (seed, iteration, strategy): 2 × 2 × 7 = 28.
    assert progress == list(STRATEGIES) * 4
    assert list(result.strategies) == list(STRATEGIES)
    for name, metrics in result.strategies.items():
        assert set(metrics) == METRIC_KEYS, name
        for summary in metrics.values():
            assert math.isfinite(summary.mean) and math.isfinite(summary.std)
        # Equal budget: M(1 + N/2) = 32 × (1 + 2/2) = 64 units, on every seed (std 0).
        assert (metrics["units"].mean, metrics["units"].std) == (64.0, 0.0), name
        if name in ("grpo", "pcl"):  # the flat strategies: one anchor per tree, its root
            # 64 units are 8 groups of 8, one per prompt: a prompt is mixed exactly when its
            # group is, and mixed/100u = 100 × (8 × ratio) / 64 = 12.5 × ratio.
            ratio = metrics["prompt_effective_ratio"].mean
            assert metrics["anchor_effective_ratio"].mean == pytest.approx(ratio), name
            assert metrics["mixed_per_100_units"].mean == pytest.approx(12.5 * ratio), name
    data = json.loads(json.dumps(result.to_json()))  # survives a JSON round trip
    check_allocation_json(data, list(STRATEGIES))
    assert data["config"]["prompts"] == 64 and data["config"]["budget"] == 32
    assert data["config"]["sim"] == json.loads(json.dumps(vars(SimConfig())))


def test_allocation_bench_is_deterministic(tmp_path: Path) -> None:
    config = AllocationBenchConfig(
        prompts=32, budget=16, seeds=1, iterations=2, strategies=("grpo", "trace", "oracle")
    )
    first, again = run_allocation_bench(config), run_allocation_bench(config)
    assert first.to_json() == again.to_json()
    first.write_json(tmp_path / "out.json")
    check_allocation_json(json.loads((tmp_path / "out.json").read_text()), list(config.strategies))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategies": ("grpo", "nope")}, "unknown strategy 'nope'"),
        ({"prompts": 0}, "prompts must be >= 1"),
        ({"seeds": 0}, "seeds and iterations"),
        ({"budget": 1}, "roots must be at least 2"),
        ({"group": 1}, "group must be at least 2"),
        ({"strategies": ()}, "strategies is empty"),
    ],
)
def test_allocation_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AllocationBenchConfig(**kwargs)  # type: ignore[arg-type]


# --- the real command line ---------------------------------------------------------------
def trace_rl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``trace-rl`` (the console script beside this Python, else ``python -m``)."""
    script = Path(sys.executable).with_name("trace-rl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trace_core.cli"]
    # A wide terminal so rich neither wraps table cells nor error messages.
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # runs trace-rl
def test_cli_help(tmp_path: Path) -> None:
    top = trace_rl("--help", cwd=tmp_path)
    assert top.returncode == 0, top.stderr
    assert "bench" in top.stdout
    bench = trace_rl("bench", "--help", cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    assert "allocation" in bench.stdout and "allocator-speed" in bench.stdout


@pytest.mark.slow  # runs trace-rl
def test_cli_bench_allocation(tmp_path: Path) -> None:
    out, png = tmp_path / "allocation.json", tmp_path / "allocation.png"
    run = trace_rl(
        "bench", "allocation", "--prompts", "64", "--budget", "32", "--seeds", "1",
        "--iterations", "2", "--json", str(out), "--plot", str(png),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for name in STRATEGIES:
        assert f" {name} " in run.stdout, name
    data = json.loads(out.read_text())
    check_allocation_json(data, list(STRATEGIES))
    assert data["config"]["seeds"] == 1 and data["config"]["iterations"] == 2
    assert all(m["units"]["mean"] == 64.0 for m in data["strategies"].values())
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow  # runs trace-rl
def test_cli_bench_allocator_speed(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    run = trace_rl(
        "bench", "allocator-speed", "--sizes", "16,32", "--large", "2000",
        "--dp-max-prompts", "16", "--json", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompts"] for r in rows] == [16, 32, 2000]
    assert [r["budget"] for r in rows] == [64, 128, 8000]  # M = 4B
    small, mid, large = rows
    assert all(math.isfinite(r["fast_seconds"]) for r in rows)
    # B = 16 ran the DP: measured, with a ratio and an objective gap within 1e-9.
    assert small["dp_seconds"] is not None and small["dp_estimated_seconds"] is None
    assert small["speedup"] is not None and math.isfinite(small["speedup"])
    assert small["objective_gap"] <= 1e-9
    # B = 32 is past --dp-max-prompts: not run, estimated from the B = 16 run.
    assert mid["dp_seconds"] is None and mid["dp_estimated_seconds"] is not None
    assert mid["speedup"] is None and mid["objective_gap"] is None
    # The large size runs the fast solver alone: no DP, no estimate.
    assert large["dp_seconds"] is None and large["dp_estimated_seconds"] is None
    assert large["speedup"] is None and large["objective_gap"] is None
    assert "(est., not run)" in run.stdout and "not run" in run.stdout


@pytest.mark.slow  # runs trace-rl (≈ 15 s: a megabyte of each shape, three times)
def test_cli_bench_parse_as_the_readme_prints_it(tmp_path: Path) -> None:
    run = trace_rl("bench", "parse", "--json", "parse.json", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "parse.json").read_text())
    assert [r["shape"] for r in rows] == list(hostile(8))
    for r in rows:
        assert 6_000 <= r["reference_chars"] <= 10_010
        assert 750_000 <= r["large_chars"] <= 1_250_010
        seconds = ("reference_seconds", "linear_seconds", "large_seconds", "bfcl_large_seconds")
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in seconds)
        assert r["speedup"] == pytest.approx(r["reference_seconds"] / r["linear_seconds"])
    assert "quadratic / linear" in run.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "parse", "--repeat", "0"], "--repeat >= 1"),
        (
            ["bench", "allocation", "--difficulty", "gamma:1"],
            "difficulty must look like 'beta:a,b'",
        ),
        (["bench", "allocation", "--strategies", "grpo,nope"], "unknown strategy 'nope'"),
        (["bench", "allocation", "--turns", "3"], "turns must look like 'lo,hi'"),
        (["bench", "allocation", "--turns", "1,1"], "turns hi must be >= 2"),
        (["bench", "allocator-speed", "--sizes", "a,b"], "--sizes must be comma-separated"),
        (["bench", "allocator-speed", "--sizes", "-4", "--large", "0"], "sizes must be >= 1"),
        (["bench", "allocation", "--difficulty", "beta:1e400,1"], "> 0 and finite"),
        (["bench", "allocation", "--no-such-flag"], "No such option"),
    ],
    ids=[
        "parse-repeat",
        "difficulty",
        "strategies",
        "turns-form",
        "turns-hi",
        "sizes",
        "negative-size",
        "overflow",
        "unknown-flag",
    ],
)
@pytest.mark.slow  # runs trace-rl
def test_cli_rejects_bad_flags(args: list[str], message: str, tmp_path: Path) -> None:
    run = trace_rl(*args, cwd=tmp_path)
    assert run.returncode != 0
    said = " ".join((run.stdout + run.stderr).split())  # undo any line wrapping
    assert message in said, said
    assert "Traceback" not in said


def test_allocator_speed_estimates_from_the_largest_measured_dp() -> None:
    # Sizes come in any order; rows are sorted, and B = 32 (not run) is scaled from B = 16:
    # B·M² grows by 2 · 2² = 8.
    rows = run_allocator_speed((32, 16, 8), large=None, dp_max_prompts=16)
    assert [r.prompts for r in rows] == [8, 16, 32]
    assert rows[2].dp_seconds is None and rows[1].dp_seconds is not None
    assert rows[2].dp_estimated_seconds == pytest.approx(8 * rows[1].dp_seconds)
    assert all(r.objective_gap is not None and r.objective_gap <= 1e-9 for r in rows[:2])
