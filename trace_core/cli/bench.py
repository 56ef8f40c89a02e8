"""``trace-rl bench ...``: every benchmark prints ratios against a baseline run in the same
command, and writes its figures with ``--json``.

    trace-rl bench allocation --prompts 2048 --budget 1024 --continuations 2 --json out.json
    trace-rl bench allocator-speed --json speed.json

The Ray and GPU benchmarks (workers, reload, gpu) are ``cli.bench_ray``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trace_core.algo.plan import STRATEGIES
from trace_core.bench.allocation import (
    METRICS,
    AllocationBenchConfig,
    AllocationBenchResult,
    run_allocation_bench,
)
from trace_core.bench.allocator_speed import (
    DEFAULT_SIZES,
    DP_MAX_PROMPTS,
    LARGE_SIZE,
    SpeedRow,
    rows_to_json,
)
from trace_core.bench.allocator_speed import run_allocator_speed as _run_speed
from trace_core.bench.parsing import LARGE_CHARS, REFERENCE_CHARS
from trace_core.cli.output import console, expected_errors, fail, progress, write_json
from trace_core.envs.sim.world import SimConfig, parse_beta, parse_range

app = typer.Typer(help="Benchmarks that print ratios against a baseline run alongside.")


@app.command("allocation")
def bench_allocation(
    prompts: Annotated[int, typer.Option(help="B: candidate prompts per iteration.")] = 2048,
    budget: Annotated[int, typer.Option(help="M: root rollouts of a tree strategy.")] = 1024,
    continuations: Annotated[int, typer.Option(help="N: continuations per root.")] = 2,
    group: Annotated[int, typer.Option(help="Group size of fixed-group strategies.")] = 8,
    difficulty: Annotated[str, typer.Option(help="Prompt success probability, beta:a,b.")] = (
        "beta:0.4,0.4"
    ),
    turns: Annotated[str, typer.Option(help="Turns per episode, lo,hi.")] = "2,6",
    seeds: Annotated[int, typer.Option(help="Independent repetitions.")] = 3,
    iterations: Annotated[int, typer.Option(help="Iterations per seed (1st is warm-up).")] = 4,
    strategies: Annotated[str, typer.Option(help="Comma-separated strategies to run.")] = ",".join(
        STRATEGIES
    ),
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG bar chart here.")] = None,
) -> None:
    """Every strategy at an equal rollout budget on the simulator (mean ± std over seeds)."""
    config = AllocationBenchConfig(
        prompts=prompts,
        budget=budget,
        continuations=continuations,
        group=group,
        sim=SimConfig(difficulty=parse_beta(difficulty), turns=parse_range(turns, "turns")),
        seeds=seeds,
        iterations=iterations,
        strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
    )
    with progress() as bar:
        task = bar.add_task("simulating", total=seeds * iterations * len(config.strategies))
        result = run_allocation_bench(
            config, progress=lambda name: bar.update(task, advance=1, description=name)
        )
    console.print(_allocation_table(result))
    write_json(json_path, result.to_json())
    if plot:
        _plot_allocation(result, plot)
        console.print(f"wrote {plot}")


def _allocation_table(result: AllocationBenchResult) -> Table:
    c = result.config
    table = Table(
        title=(
            f"Equal budget: B={c.prompts} prompts, M={c.budget} roots × N={c.continuations}"
            f" → {c.budget * (1 + c.continuations / 2):g} units; {c.seeds} seeds × "
            f"{c.iterations} iterations"
        )
    )
    heads = ["prompt eff.", "anchor eff.", "mixed/100u", "contrast pairs", "units", "tokens"]
    table.add_column("strategy")
    for head in heads:
        table.add_column(head, justify="right")
    ratios = [b for b in ("grpo", "oracle") if b in result.strategies]
    for base in ratios:
        table.add_column(f"mixed/100u ÷ {base}", justify="right")
    for name, metrics in result.strategies.items():
        cells = []
        for metric in METRICS:
            s = metrics[metric]
            fmt = ".3f" if "ratio" in metric else (".2f" if "per_100" in metric else ",.0f")
            cells.append(f"{s.mean:{fmt}} ± {s.std:{fmt}}")
        for base in ratios:
            denominator = result.strategies[base]["mixed_per_100_units"].mean
            mine = metrics["mixed_per_100_units"].mean
            cells.append(f"{mine / denominator:.2f}×" if denominator else "—")
        table.add_row(name, *cells)
    return table


def _plot_allocation(result: AllocationBenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result.strategies)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in (
        (axes[0], "mixed_per_100_units", "mixed groups per 100 rollout units"),
        (axes[1], "prompt_effective_ratio", "prompt effective ratio"),
    ):
        means = [result.strategies[n][metric].mean for n in names]
        stds = [result.strategies[n][metric].std for n in names]
        ax.bar(names, means, yerr=stds, color="#4c72b0", capsize=3)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@app.command("allocator-speed")
def bench_allocator_speed(
    sizes: Annotated[str, typer.Option(help="Pool sizes B (M = 4B), comma-separated.")] = ",".join(
        map(str, DEFAULT_SIZES)
    ),
    large: Annotated[int, typer.Option(help="Fast solver alone at this B (0: skip).")] = (
        LARGE_SIZE
    ),
    dp_max_prompts: Annotated[
        int, typer.Option(help="Largest B the O(B·M²) DP is run at; larger ones are estimated.")
    ] = DP_MAX_PROMPTS,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """The paper's DP against the exact fast solver: seconds and DP/fast ratio."""
    try:
        size_list = tuple(int(s) for s in sizes.split(",") if s.strip())
    except ValueError:
        raise fail(f"--sizes must be comma-separated integers, got {sizes!r}") from None
    with console.status("timing solvers") as status:
        rows = _run_speed(
            size_list, large or None, dp_max_prompts, progress=lambda msg: status.update(msg)
        )
    console.print(_speed_table(rows))
    write_json(json_path, rows_to_json(rows))


def _speed_table(rows: list[SpeedRow]) -> Table:
    table = Table(title="Stage-1 root allocation: paper's DP vs exact fast solver (M = 4B)")
    for head in ("B", "M", "fast s", "DP s", "DP / fast", "objective gap"):
        table.add_column(head, justify="right")
    for r in rows:
        if r.dp_seconds is not None:
            dp, ratio = f"{r.dp_seconds:.3f}", f"{r.speedup:,.0f}×"
        elif r.dp_estimated_seconds is not None:
            dp, ratio = f"~{r.dp_estimated_seconds:,.3g} (est., not run)", "—"
        else:
            dp, ratio = "not run", "—"
        gap = "—" if r.objective_gap is None else f"{r.objective_gap:.1e}"
        table.add_row(f"{r.prompts:,}", f"{r.budget:,}", f"{r.fast_seconds:.4f}", dp, ratio, gap)
    return table


@app.command("parse")
def bench_parse(
    reference_chars: Annotated[
        int, typer.Option(help="Text length both parsers read (the quadratic one's limit).")
    ] = REFERENCE_CHARS,
    large_chars: Annotated[int, typer.Option(help="Text length the linear parsers read.")] = (
        LARGE_CHARS
    ),
    repeat: Annotated[int, typer.Option(help="Best of this many runs.")] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Action parsing on hostile turns: the linear parser vs the quadratic definition."""
    from trace_core.bench.parsing import rows_to_json, run_parse_bench

    with console.status("parsing") as status:
        rows = run_parse_bench(reference_chars, large_chars, repeat, progress=status.update)
    table = Table(title="Reading the action off a hostile turn (best of runs, seconds)")
    heads = ("shape", "chars", "quadratic", "linear", "quadratic / linear")
    for head in (*heads, f"linear, {large_chars:,} chars", f"bfcl, {large_chars:,} chars"):
        table.add_column(head, justify="right")
    for r in rows:
        table.add_row(
            r.shape, f"{r.reference_chars:,}", f"{r.reference_seconds:.4f}",
            f"{r.linear_seconds:.5f}", _ratio(r.speedup), f"{r.large_seconds:.3f}",
            f"{r.bfcl_large_seconds:.3f}",
        )  # fmt: skip
    console.print(table)
    write_json(json_path, rows_to_json(rows))


@app.command("update")
def bench_update(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    budgets: Annotated[
        str, typer.Option(help="Micro-batch token budgets, comma-separated; 0 is unbatched.")
    ] = "0,2048,1024,512",
    paths: Annotated[int, typer.Option(help="Paths in the minibatch.")] = 8,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt tokens per path.")] = 128,
    generated_tokens: Annotated[int, typer.Option(help="Generated tokens per path.")] = 128,
    checkpointing: Annotated[bool, typer.Option(help="Gradient checkpointing on.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Peak memory of one update per micro-batch budget, against the unbatched update."""
    from trace_core.bench.update import (
        SIZES,
        UpdateBenchConfig,
        estimates,
        rows_to_json,
        run_update_bench,
    )
    from trace_core.policy.checkpoint import check_checkpoint

    try:
        sizes = tuple(int(b) for b in budgets.split(","))
    except ValueError:
        raise fail(f"--budgets must be integers separated by commas, got {budgets!r}") from None
    check_checkpoint(checkpoint, "--checkpoint")
    config = UpdateBenchConfig(
        str(checkpoint), sizes, paths, prompt_tokens, generated_tokens, checkpointing, device
    )
    with console.status("one update per budget, each in a fresh process"):
        rows = run_update_bench(config)
    out = rows_to_json(config, rows)
    minibatch = paths * (prompt_tokens + generated_tokens)
    table = Table(title=f"One update of {paths} paths ({minibatch:,} tokens), {checkpoint}")
    for head in ("tokens/pass", "passes", "peak GiB", "update GiB", "vs unbatched", "estimate"):
        table.add_column(head, justify="right")
    for row, entry in zip(rows, out["rows"], strict=True):  # type: ignore[call-overload]
        ratio = entry["update_ratio"]
        table.add_row(
            "all" if row.budget == 0 else f"{row.budget:,}", str(row.passes),
            f"{row.peak_gib:.2f}", f"{row.update_gib:.2f}",
            "-" if ratio is None else f"{ratio:.2f}×", f"{row.estimate_gib:.2f}",
        )  # fmt: skip
    console.print(table)
    sizes_table = Table(title="Estimated GiB of one update on CUDA (bf16 autocast, fp32 AdamW)")
    sizes_table.add_column("model")
    for t in SIZES:
        for mode in ("checkpointing", "none"):
            sizes_table.add_column(f"{t:,} tok, {mode}", justify="right")
    on, off = estimates(True), estimates(False)
    for name in on:
        cells = [f"{gib:.0f}" for t in SIZES for gib in (on[name][t], off[name][t])]
        sizes_table.add_row(f"Qwen3-{name}", *cells)
    console.print(sizes_table)
    write_json(json_path, out)


def _ratio(x: float) -> str:
    return f"{x:,.0f}×" if x >= 10 else f"{x:.2g}×"


@app.command("engine")
def bench_engine(
    batch: Annotated[int, typer.Option(help="Prompts decoded together.")] = 64,
    new_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 64,
    threads: Annotated[int, typer.Option(help="Torch threads (0: torch's default).")] = 0,
    vllm_python: Annotated[
        Path | None,
        typer.Option(
            help="A Python with vLLM to time it too (.venv-vllm/bin/python: make setup-vllm)."
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="Time this HF directory (build/models/smollm2), not the tiny policy."),
    ] = None,
    repeats: Annotated[
        int, typer.Option(help="Timed rounds, the engines taking turns: medians, spread.", min=1)
    ] = 5,
    profile: Annotated[
        bool,
        typer.Option(help="Also profile TorchEngine's decode steps: where a step's time goes."),
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """TorchEngine vs HF generate (and vLLM) tokens/s on the tiny policy (or --checkpoint);
    prefill on a tree; with --profile, the parts of a TorchEngine decode step."""
    from trace_core.bench.engine import run_engine_bench
    from trace_core.policy.checkpoint import check_checkpoint

    if checkpoint is not None:
        check_checkpoint(checkpoint, "--checkpoint")
    if vllm_python is None:
        console.print(
            "vLLM: not timed (--vllm-python .venv-vllm/bin/python times it; make setup-vllm)"
        )
    with console.status("timing engines" + (" (vLLM starts in ≈20-40 s)" if vllm_python else "")):
        result = run_engine_bench(
            batch=batch,
            new_tokens=new_tokens,
            threads=threads or None,
            vllm_python=vllm_python,
            checkpoint=checkpoint,
            repeats=repeats,
            profile=profile,
        )
    model = checkpoint.name if checkpoint else "Tiny policy"
    table = Table(
        title=f"{model}, batch {batch} × {new_tokens} new tokens",
        caption="ratio_vs_hf: HF generate's seconds over TorchEngine's, the median of the "
        "repeats' paired ratios with their lowest and highest (> 1: TorchEngine is faster); "
        "tokens/s and seconds: medians; floor: the run's matmuls and attention alone, what "
        "any engine on these kernels needs at least (floor_ratio_vs_hf: HF over it; "
        "torch_vs_floor: TorchEngine over it); ratio_vs_one_process: the same engine in one "
        "process over TorchEngine on its replicas (one per thread); compiled_step: 1 when "
        "TorchEngine decoded with its compiled step (policy.native), 0 in Python; "
        "ratio_vs_python_step: the same engine decoding in Python over it with the compiled "
        "step (paired); "
        "ratio_vs_vllm: vLLM's seconds over TorchEngine's. The tree workload: tokens "
        "prefilled vs distinct token positions (unique) and vs no reuse (naive).",
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key.startswith("profile_"):
            continue
        count = key in ENGINE_BENCH_COUNTS or not isinstance(value, float)
        table.add_row(key, f"{value:,.0f}" if count else f"{value:,.2f}")
    console.print(table)
    if profile:
        console.print(_profile_table(result, model, batch, new_tokens))
    write_json(json_path, result)


def _profile_table(result: dict[str, float], model: str, batch: int, new_tokens: int) -> Table:
    """``bench engine --profile``'s parts of a decode step (``bench.engine_profile``)."""
    from trace_core.bench.engine_profile import PARTS

    steps, wall = result["profile_decode_steps"], result["profile_wall_us_per_step"]
    profiled = result["profile_profiled_us_per_step"]
    table = Table(
        title=f"{model}: a TorchEngine decode step, batch {batch} × {new_tokens} new tokens "
        f"({steps:,.0f} steps; {wall:,.0f} µs a step unprofiled, {profiled:,.0f} profiled)",
        caption="ops: torch operations the step's Python calls (a count: the same on any "
        "machine); µs: their CPU time under the profiler; outside ops: Python, argument "
        "parsing and the profiler's own cost. Admission and retirement are spread over the "
        "steps.",
    )
    for column in ("part", "ops / step", "µs / step", "share of profiled"):
        table.add_column(column, justify="left" if column == "part" else "right")
    rows = [
        (part, result[f"profile_{part}_ops_per_step"], result[f"profile_{part}_us_per_step"])
        for part in PARTS
    ]
    rows.append(("outside_ops", 0.0, result["profile_outside_ops_us_per_step"]))
    for part, ops, micros in rows:
        share = f"{micros / profiled:.0%}"
        table.add_row(part.replace("_", " "), f"{ops:,.1f}", f"{micros:,.0f}", share)
    return table


ENGINE_BENCH_COUNTS = frozenset(
    {
        *("batch", "new_tokens", "prompt_tokens", "threads", "prefill_tokens", "unique_tokens"),
        *("generated_tokens", "requested_prompt_tokens", "naive_prefill_tokens", "tree_calls"),
        "repeats",
        "replicas",
        "compiled_step",
    }
)
"""``bench engine``'s figures that are counts, printed as integers."""


@app.command("contrast")
def bench_contrast(
    checkpoint: Annotated[Path, typer.Option(help="Warm-started policy directory.")] = Path(
        "build/policy/calc"
    ),
    task: Annotated[str, typer.Option(help="Task suite.")] = "calc",
    prompts: Annotated[int, typer.Option(help="Candidate prompts per pool.")] = 512,
    budget: Annotated[int, typer.Option(help="M: root rollouts of a tree strategy.")] = 128,
    continuations: Annotated[int, typer.Option(help="N: continuations per root.")] = 2,
    group: Annotated[int, typer.Option(help="Group size of fixed-group strategies.")] = 8,
    iterations: Annotated[int, typer.Option(help="Iterations (1st is warm-up).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of pools and sampling.")] = 0,
    threads: Annotated[int, typer.Option(help="Torch threads (0: torch's default).")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Every strategy at equal budget with the real policy, engine and task."""
    import torch

    from trace_core.bench.contrast import ContrastBenchConfig, run_contrast_bench

    if threads:
        torch.set_num_threads(threads)
    if not (checkpoint / "config.json").exists():
        raise fail(f"no policy at {checkpoint}: run `trace-rl warmstart --output {checkpoint}`")
    config = ContrastBenchConfig(
        checkpoint, task, prompts, budget, continuations, group, iterations, seed
    )
    with progress() as bar:
        job = bar.add_task("rolling out", total=iterations * len(config.strategies))
        result = run_contrast_bench(
            config, progress=lambda name: bar.update(job, advance=1, description=name)
        )
    table = Table(
        title=f"{task}, equal budget: M={budget} roots × N={continuations} → "
        f"{budget * (1 + continuations / 2):g} units; real policy and env "
        "(paper, math: prompt effective ratio 26.8% GRPO → 60.6% TRACE)"
    )
    table.add_column("strategy")
    for head in ("prompt eff.", "anchor eff.", "mixed/100u", "÷ grpo", "tokens", "tokens/s"):
        table.add_column(head, justify="right")
    base = result.strategies.get("grpo", {}).get("mixed_per_100_units")
    for name, m in result.strategies.items():
        ratio = m["mixed_per_100_units"].mean / base.mean if base and base.mean else float("nan")
        table.add_row(
            name,
            f"{m['prompt_effective_ratio'].mean:.3f}",
            f"{m['anchor_effective_ratio'].mean:.3f}",
            f"{m['mixed_per_100_units'].mean:.2f} ± {m['mixed_per_100_units'].std:.2f}",
            f"{ratio:.2f}×",
            f"{m['tokens'].mean:,.0f}",
            f"{m['tokens_per_s'].mean:,.0f}",
        )
    console.print(table)
    write_json(json_path, result.to_json())


@app.command("predictor")
def bench_predictor(
    trees: Annotated[str, typer.Option(help="Parquet trees: a directory, a file or a glob.")],
    featurizer: Annotated[str, typer.Option(help="hashed, embedding or both.")] = "hashed",
    checkpoint: Annotated[
        Path, typer.Option(help="Policy directory whose tokenizer wrote the trees.")
    ] = Path("build/policy/calc"),
    heldout: Annotated[float, typer.Option(help="Share of prompt ids held out.")] = 0.25,
    hidden: Annotated[int, typer.Option(help="MLP hidden width (0: logistic).")] = 64,
    epochs: Annotated[int, typer.Option(help="Passes over the training rows.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the split, weights and batches.")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Held-out Brier score and AUC of the predictor, roots and unseen prefixes, vs a constant."""
    from trace_core.bench.predictor import (
        PredictorBenchConfig,
        load_policy_tokenizer,
        predictor_config,
        run_predictor_bench,
        tree_paths,
    )

    names = ("hashed", "embedding") if featurizer == "both" else (featurizer,)
    tokenizer = load_policy_tokenizer(checkpoint)
    settings = predictor_config(tokenizer, names[0], hidden, epochs)
    config = PredictorBenchConfig(tree_paths(trees), settings, names, heldout, seed)
    with console.status("fitting") as status:
        result = run_predictor_bench(
            config, tokenizer, progress=lambda name: status.update(f"fitting {name}")
        )
    table = Table(
        title=f"Success predictor on {result.heldout_trees} held-out trees "
        f"({result.train_trees} train, {result.prompts} prompts; pairs = node × descendant leaf)"
    )
    heads = ("nodes", "pairs", "success", "Brier", "Brier const", "skill", "AUC", "fit s")
    table.add_column("predictor")
    table.add_column("nodes of")
    for head in heads:
        table.add_column(head, justify="right")
    for name, run in result.runs.items():
        for label, s in (("roots", run.report.roots), ("unseen prefixes", run.report.prefixes)):
            table.add_row(
                name,
                label,
                f"{s.nodes:,}",
                f"{s.pairs:,}",
                f"{s.success_rate:.3f}",
                f"{s.brier:.4f}",
                f"{s.brier_constant:.4f}",
                f"{s.brier_skill:+.3f}",
                f"{s.auc:.3f}",
                f"{run.fit_seconds:.1f}",
            )
    console.print(table)
    write_json(json_path, result.to_json())


@app.command("store")
def bench_store(
    trees: Annotated[int, typer.Option(help="N: simulator trees in both formats.")] = 1000,
    query_nodes: Annotated[int, typer.Option(help="Nodes the query filters (0: skip).")] = (
        1_000_000
    ),
    repeats: Annotated[int, typer.Option(help="Timed reads and queries; the best counts.")] = 5,
    s3: Annotated[
        str, typer.Option(help="auto (SeaweedFS on 127.0.0.1), none, or s3://bucket/prefix.")
    ] = "auto",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Parquet vs JSON Lines (bytes, seconds, ratios) locally and on S3; a query over 1M nodes."""
    from trace_core.bench.store import StoreBenchConfig, run_store_bench

    config = StoreBenchConfig(trees=trees, query_nodes=query_nodes, repeats=repeats, s3=s3)
    with expected_errors(RuntimeError), console.status("benchmarking storage") as status:
        result = run_store_bench(config, progress=lambda m: status.update(m))
    table = Table(title=f"{result.trees:,} simulator trees, {result.nodes:,} nodes")
    heads = (
        "where",
        "data",
        "Parquet MB",
        "JSONL MB",
        "size ×",
        "Parquet read s",
        "JSONL read s",
        "read ×",
        "Parquet write s",
        "JSONL write s",
    )
    for head in heads:
        table.add_column(head, justify="right")
    for r in result.formats:
        table.add_row(
            r.where,
            r.data,
            f"{r.parquet_bytes / 1e6:.2f}",
            f"{r.jsonl_bytes / 1e6:.2f}",
            f"{r.size_ratio:.1f}×",
            f"{r.parquet_read_seconds:.3f}",
            f"{r.jsonl_read_seconds:.3f}",
            f"{r.read_speedup:.1f}×",
            f"{r.parquet_write_seconds:.3f}",
            f"{r.jsonl_write_seconds:.3f}",
        )
    console.print(table)
    for q in result.queries:
        console.print(
            f"query ({q.where}): {q.nodes:,} nodes ({q.file_bytes / 1e6:.0f} MB file) → "
            f"{q.rows:,} rows in {q.seconds:.3f} s"
        )
    for note in result.notes:
        console.print(note)
    write_json(json_path, result.to_json())
