"""``trace-rl``: the command line. Thin: parse flags, build a config, call one function, print.

trace-rl bench allocation --prompts 2048 --budget 1024 --continuations 2 --json out.json
trace-rl bench allocator-speed --json speed.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trace_core.algo.plan import STRATEGIES
from trace_core.bench.allocation import (
    METRICS,
    AllocationBenchConfig,
    AllocationBenchResult,
    run_allocation_bench,
)
from trace_core.bench.allocator_speed import DEFAULT_SIZES, LARGE_SIZE, SpeedRow, rows_to_json
from trace_core.bench.allocator_speed import run_allocator_speed as _run_speed
from trace_core.envs.sim.world import SimConfig, parse_beta, parse_range

if TYPE_CHECKING:
    from trace_core.policy.update import UpdateConfig as UpdateConfigT

app = typer.Typer(help="TRACE: tree rollout allocation for contrastive exploration.")
bench_app = typer.Typer(help="Benchmarks that print ratios against a baseline run alongside.")
task_app = typer.Typer(help="Task suites: calc, multihop, bfcl, deepscaler, hotpotqa.")
app.add_typer(bench_app, name="bench")
app.add_typer(task_app, name="task")
# Logs and CI are not terminals; keep the tables on one line there.
console = Console(width=None if sys.stdout.isatty() else 160)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)


@bench_app.command("allocation")
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
    try:
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
    except ValueError as err:
        raise _fail(str(err)) from None
    with _progress() as bar:
        task = bar.add_task("simulating", total=seeds * iterations * len(config.strategies))
        result = run_allocation_bench(
            config, progress=lambda name: bar.update(task, advance=1, description=name)
        )
    console.print(_allocation_table(result))
    if json_path:
        result.write_json(json_path)
        console.print(f"wrote {json_path}")
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


@bench_app.command("allocator-speed")
def bench_allocator_speed(
    sizes: Annotated[str, typer.Option(help="Pool sizes B (M = 4B), comma-separated.")] = ",".join(
        map(str, DEFAULT_SIZES)
    ),
    large: Annotated[int, typer.Option(help="Fast solver alone at this B (0: skip).")] = (
        LARGE_SIZE
    ),
    dp_max_prompts: Annotated[
        int, typer.Option(help="Largest B the O(B·M²) DP is run at; larger ones are estimated.")
    ] = 2048,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """The paper's DP against the exact fast solver: seconds and DP/fast ratio."""
    try:
        size_list = tuple(int(s) for s in sizes.split(",") if s.strip())
    except ValueError:
        raise _fail(f"--sizes must be comma-separated integers, got {sizes!r}") from None
    with console.status("timing solvers") as status:
        try:
            rows = _run_speed(
                size_list, large or None, dp_max_prompts, progress=lambda msg: status.update(msg)
            )
        except ValueError as err:
            raise _fail(str(err)) from None
    console.print(_speed_table(rows))
    if json_path:
        json_path.write_text(json.dumps(rows_to_json(rows), indent=2) + "\n")
        console.print(f"wrote {json_path}")


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


@bench_app.command("engine")
def bench_engine(
    batch: Annotated[int, typer.Option(help="Prompts decoded together.")] = 64,
    new_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 64,
    threads: Annotated[int, typer.Option(help="Torch threads (0: torch's default).")] = 0,
    vllm_python: Annotated[
        Path | None,
        typer.Option(
            help="A Python with vLLM to time it too (default: .venv-vllm/bin/python if it exists)."
        ),
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """TorchEngine vs HF generate (and vLLM) tokens/s on the tiny policy; prefill on a tree."""
    from trace_core.bench.engine import run_engine_bench

    default_vllm = Path(".venv-vllm/bin/python")
    if vllm_python is None and default_vllm.is_file():
        vllm_python = default_vllm
    if vllm_python is None:
        console.print("vLLM: not timed (no .venv-vllm here: make test-vllm creates it)")
    with console.status("timing engines" + (" (vLLM starts in ≈20-40 s)" if vllm_python else "")):
        result = run_engine_bench(
            batch=batch, new_tokens=new_tokens, threads=threads or None, vllm_python=vllm_python
        )
    table = Table(title=f"Tiny policy, batch {batch} × {new_tokens} new tokens")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}")
    console.print(table)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_path}")


@bench_app.command("contrast")
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
        raise _fail(f"no policy at {checkpoint}: run `trace-rl warmstart --output {checkpoint}`")
    try:
        config = ContrastBenchConfig(
            checkpoint, task, prompts, budget, continuations, group, iterations, seed
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    with _progress() as bar:
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
    if json_path:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_path}")


@bench_app.command("workers")
def bench_workers(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    prompts: Annotated[int, typer.Option(help="Candidate prompts in the pool.")] = 256,
    budget: Annotated[int, typer.Option(help="M: root rollouts.")] = 256,
    continuations: Annotated[int, typer.Option(help="N: continuations per root.")] = 2,
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 48,
    repeats: Annotated[int, typer.Option(help="Timed runs per engine; the best counts.")] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Rollout tokens/s with 1 and 2 Ray engine workers (one torch thread each), and the ratio."""
    from trace_core.bench.workers import WorkersBenchConfig, run_workers_bench

    try:
        config = WorkersBenchConfig(
            checkpoint,
            prompts=prompts,
            roots=budget,
            continuations=continuations,
            max_tokens=max_tokens,
            repeats=repeats,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    with console.status("timing rollouts") as status:
        result = run_workers_bench(config, progress=lambda msg: status.update(msg))
    table = Table(title=f"trace on calc: M={budget} roots × N={continuations}, {prompts} prompts")
    heads = ("engine", "tokens/s", "tokens", "seconds", "calls", "busy", "imbalance", "moved")
    for head in heads:
        table.add_column(head, justify="right")
    for r in result.runs:
        table.add_row(
            r.engine,
            f"{r.tokens_per_s:,.0f}",
            f"{r.generated_tokens:,}",
            f"{r.seconds:.2f}",
            f"{r.engine_calls}",
            f"{r.busy_share:.2f}",
            f"{r.imbalance_share:.2f}",
            f"{r.affinity_moved}",
        )
    console.print(table)
    console.print(
        f"ray×{config.workers[-1]} / ray×{config.workers[0]}: {result.ratio:.2f}×; "
        f"load average {result.load_average[0]:.1f} → {result.load_average[1]:.1f} "
        f"on {result.cpus} CPUs"
    )
    if json_path:
        result.write_json(json_path)
        console.print(f"wrote {json_path}")


@task_app.command("check")
def task_check(
    task: Annotated[str, typer.Argument(help="calc, multihop, bfcl, deepscaler or hotpotqa.")],
    data: Annotated[str | None, typer.Option(help="Dataset path/URI (deepscaler, hotpotqa).")] = (
        None
    ),
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Replay every task's reference solution through its env; 1.0 is expected."""
    from trace_core.envs.suites import check_references, make_suite

    try:
        suite = make_suite(task, data)
        with console.status(f"replaying {task} references"):
            report = check_references(suite)
    except ValueError as err:
        raise _fail(str(err)) from None
    table = Table(title=f"{task}: {report.tasks} reference episodes")
    table.add_column("difficulty")
    table.add_column("mean reward", justify="right")
    for label, value in report.by_difficulty.items():
        table.add_row(label, f"{value:.3f}")
    table.add_row("all", f"{report.mean_reward:.3f}")
    console.print(table)
    if report.without_reference:
        console.print(f"{report.without_reference} tasks have no reference and were not replayed")
    if report.failed:
        console.print(f"[red]not solved by their reference:[/red] {', '.join(report.failed)}")
    if json_path:
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_path}")


@app.command("warmstart")
def warmstart_command(
    task: Annotated[str, typer.Option(help="Synthetic task: calc or multihop.")] = "calc",
    output: Annotated[Path, typer.Option(help="Checkpoint directory to write.")] = Path(
        "build/policy/calc"
    ),
    steps: Annotated[int, typer.Option(help="SFT optimizer steps.")] = 1000,
    demos: Annotated[int, typer.Option(help="Demonstration episodes.")] = 6000,
    seed: Annotated[int, typer.Option(help="Seed of tasks, demos, weights, sampling.")] = 0,
    eval_tasks: Annotated[int, typer.Option(help="Eval tasks in the success report.")] = 200,
    eval_samples: Annotated[int, typer.Option(help="Sampled episodes per eval task.")] = 4,
    threads: Annotated[int, typer.Option(help="Torch threads (0: torch's default).")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """SFT of the tiny policy on scripted demos; prints eval success per difficulty."""
    from dataclasses import asdict

    from trace_core.policy.sft import SFTConfig
    from trace_core.train.warmstart import WarmstartConfig, set_threads, warmstart

    set_threads(threads)
    try:
        config = WarmstartConfig(
            task=task,
            output=output,
            seed=seed,
            demos=demos,
            sft=SFTConfig(steps=steps, seed=seed),
            eval_tasks=eval_tasks,
            eval_samples=eval_samples,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    with _progress() as bar:
        job = bar.add_task("warm start (SFT)", total=steps)
        report = warmstart(
            config,
            progress=lambda step, loss: bar.update(
                job, completed=step + 1, description=f"warm start (SFT) loss {loss:.3f}"
            ),
        )
    table = Table(
        title=f"{task} warm start: {report.steps} steps in {report.train_seconds:.0f} s, "
        f"final loss {report.final_loss:.3f} → {report.checkpoint}"
    )
    for head in ("difficulty", "demo success", "policy success (eval)"):
        table.add_column(head, justify="right")
    for label, value in report.success.items():
        table.add_row(label, f"{report.demo_success.get(label, float('nan')):.2f}", f"{value:.2f}")
    console.print(table)
    if json_path:
        json_path.write_text(json.dumps(asdict(report), indent=2) + "\n")
        console.print(f"wrote {json_path}")


@app.command("rollout-demo")
def rollout_demo(
    task: Annotated[str, typer.Option(help="Synthetic task: calc or multihop.")] = "calc",
    checkpoint: Annotated[
        Path | None, typer.Option(help="Policy directory; warm-started here if missing.")
    ] = None,
    prompts: Annotated[int, typer.Option(help="Eval tasks to roll out.")] = 3,
    samples: Annotated[int, typer.Option(help="Episodes per task.")] = 2,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
) -> None:
    """Sample a few flat multi-turn rollouts with the tiny policy and print them."""
    from trace_core.policy.engine import SamplingParams
    from trace_core.policy.format import TurnFormat
    from trace_core.policy.model import load_checkpoint
    from trace_core.policy.torch_engine import TorchEngine
    from trace_core.rollout.flat import rollout_flat
    from trace_core.train.warmstart import WarmstartConfig, synthetic_suite, warmstart

    path = checkpoint or Path(f"build/policy/{task}")
    try:
        suite = synthetic_suite(task)
    except ValueError as err:
        raise _fail(str(err)) from None
    if not (path / "config.json").exists():
        console.print(f"no policy at {path}: warm-starting one first")
        with console.status("warm start"):
            warmstart(WarmstartConfig(task=task, output=path))
    model, tokenizer = load_checkpoint(path)
    fmt = TurnFormat(tokenizer)
    tasks = suite.tasks("eval")[:prompts]
    trees = rollout_flat(
        TorchEngine(model), fmt, suite.make_env, tasks, SamplingParams(n=samples), seed
    )
    for task_, tree in zip(tasks, trees, strict=True):
        console.rule(f"{task_.id} ({task_.difficulty}) — answer {task_.answer}")
        console.print(f"[bold]prompt:[/bold] {task_.prompt}")
        for first in tree.children()[0]:
            node = int(first)
            while True:
                console.print(f"  [cyan]agent:[/cyan] {tree.text[node]}")
                console.print(f"  [magenta]env:[/magenta]   {tree.observation[node]}")
                kids = tree.children()[node]
                if not len(kids):
                    console.print(f"  [bold]reward {tree.reward[node]:.0f}[/bold]")
                    break
                node = int(kids[0])


@app.command("prep")
def prep_command(
    task: Annotated[str, typer.Option(help="calc, multihop, bfcl, deepscaler or hotpotqa.")] = (
        "calc"
    ),
    data: Annotated[str | None, typer.Option(help="Dataset path/URI (loader tasks).")] = None,
    split: Annotated[str, typer.Option(help="train or eval.")] = "train",
    limit: Annotated[int, typer.Option(help="Keep the first N tasks (0: all).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic generators.")] = 0,
    output: Annotated[Path, typer.Option(help="Prompt Parquet to write.")] = Path(
        "build/prompts/calc-train.parquet"
    ),
) -> None:
    """Data prep: a task's prompts (one split) as a Parquet file for `trace-rl rollout`."""
    from trace_core.envs.prompts import write_prompts
    from trace_core.envs.suites import make_suite

    if split not in ("train", "eval"):
        raise _fail(f"--split must be train or eval, got {split!r}")
    try:
        tasks = make_suite(task, data, seed).tasks(split)  # type: ignore[arg-type]
        tasks = tasks[:limit] if limit else tasks
        write_prompts(output, task, tasks)
    except ValueError as err:
        raise _fail(str(err)) from None
    console.print(f"wrote {len(tasks)} {task} {split} prompts to {output}")


@app.command("rollout")
def rollout_command(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    task: Annotated[str, typer.Option(help="calc, multihop, bfcl, deepscaler or hotpotqa.")] = (
        "calc"
    ),
    data: Annotated[str | None, typer.Option(help="Dataset path/URI (loader tasks).")] = None,
    prompt_file: Annotated[
        str | None,
        typer.Option(help="Prompt Parquet (from `trace-rl prep`, path or s3://): the pool."),
    ] = None,
    predictor_dir: Annotated[
        Path | None,
        typer.Option(
            "--predictor",
            help="Success predictor folder (`trace-rl predictor fit`, or a training "
            "iteration's predictor/); default: a constant 0.5.",
        ),
    ] = None,
    strategy: Annotated[str, typer.Option(help="Allocation strategy.")] = "trace",
    budget: Annotated[int, typer.Option(help="M: root rollouts (tree strategies).")] = 64,
    continuations: Annotated[int, typer.Option(help="N: continuations per root.")] = 2,
    group: Annotated[int, typer.Option(help="Group size of fixed-group strategies.")] = 8,
    prompts: Annotated[int, typer.Option(help="Candidate prompts in the pool.")] = 256,
    split: Annotated[str, typer.Option(help="Which split the pool is drawn from.")] = "train",
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 48,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the pool, plan and sampling.")] = 0,
    output: Annotated[Path, typer.Option(help="Parquet file of the trees.")] = Path(
        "build/rollout/trees.parquet"
    ),
    metrics: Annotated[Path, typer.Option(help="Metrics JSON.")] = Path(
        "build/rollout/metrics.json"
    ),
    workers: Annotated[
        int, typer.Option(help="Ray engine workers (0: one TorchEngine in this process).")
    ] = 0,
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            help="Ray head (host:port) for --workers; default: Ray started in this process.",
        ),
    ] = None,
) -> None:
    """One rollout phase: grow budgeted trees with the policy; write Parquet and metrics."""
    import contextlib

    import numpy as np

    from trace_core.algo.metrics import measure
    from trace_core.algo.plan import Budget
    from trace_core.envs.suites import make_suite
    from trace_core.policy.engine import Engine, SamplingParams
    from trace_core.policy.format import TurnFormat
    from trace_core.policy.model import load_checkpoint
    from trace_core.policy.torch_engine import TorchEngine
    from trace_core.rollout.grow import GrowConfig, grow_trees
    from trace_core.rollout.predictor import ConstantPredictor, Predictor
    from trace_core.store.schema import write_trees

    if split not in ("train", "eval"):
        raise _fail(f"--split must be train or eval, got {split!r}")
    if workers < 0:
        raise _fail(f"--workers must be >= 0, got {workers}")
    try:
        file_tasks = None
        if prompt_file:
            from trace_core.envs.prompts import read_prompts

            task, file_tasks = read_prompts(prompt_file)
        suite = make_suite(task, data, seed)
        config = GrowConfig(
            strategy,
            Budget(budget, continuations, group),
            SamplingParams(max_tokens=max_tokens, temperature=temperature),
            seed=seed,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    tasks = file_tasks or suite.tasks("train" if split == "train" else "eval")
    rng = np.random.default_rng(seed)
    pool = [tasks[i] for i in rng.permutation(len(tasks))[:prompts]]
    with contextlib.ExitStack() as stack:
        engine: Engine
        if workers:
            from transformers import AutoTokenizer

            from trace_core.rollout.ray_pool import RayEnginePool

            tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
            with console.status(f"starting {workers} Ray engine workers"):
                try:
                    engine = stack.enter_context(
                        RayEnginePool(checkpoint, workers=workers, address=ray_address)
                    )
                except (RuntimeError, ConnectionError) as err:
                    raise _fail(str(err)) from None
        else:
            model, tokenizer = load_checkpoint(checkpoint)
            engine = TorchEngine(model)
        predictor: Predictor = ConstantPredictor()
        if predictor_dir:
            from trace_core.policy.value import ValuePredictor

            try:
                predictor = ValuePredictor.load(predictor_dir, tokenizer=tokenizer)
            except (FileNotFoundError, ValueError) as err:
                raise _fail(str(err)) from None
        with _progress() as bar:
            job = bar.add_task("rollout units", total=config.budget.units)
            trees = grow_trees(
                engine,
                TurnFormat(tokenizer),
                suite.make_env,
                pool,
                predictor,
                config,
                progress=lambda spent: bar.update(job, completed=spent),
            )
    result = measure(trees)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_trees(output, trees)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(json.dumps({"strategy": strategy, **result.as_dict()}, indent=2) + "\n")
    console.print(
        f"{len(trees)} trees, {result.units:g} units, {result.tokens:,} tokens; "
        f"prompt effective ratio {result.prompt_effective_ratio:.3f}, "
        f"mixed groups per 100 units {result.mixed_per_100_units:.2f}"
    )
    console.print(f"wrote {output} and {metrics}")


# --- the shared success predictor ----------------------------------------------------------------
predictor_app = typer.Typer(help="The shared success predictor V(prefix): fit it on stored trees.")
app.add_typer(predictor_app, name="predictor")


@bench_app.command("predictor")
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
        run_predictor_bench,
        tree_paths,
        value_config,
    )

    names = ("hashed", "embedding") if featurizer == "both" else (featurizer,)
    try:
        tokenizer = load_policy_tokenizer(checkpoint)
        value = value_config(tokenizer, names[0], hidden, epochs)
        config = PredictorBenchConfig(tree_paths(trees), value, names, heldout, seed)
    except ValueError as err:
        raise _fail(str(err)) from None
    with console.status("fitting") as status:
        try:
            result = run_predictor_bench(
                config, tokenizer, progress=lambda name: status.update(f"fitting {name}")
            )
        except ValueError as err:
            raise _fail(str(err)) from None
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
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_path}")


@predictor_app.command("fit")
def predictor_fit(
    trees: Annotated[str, typer.Option(help="Parquet trees: a directory, a file or a glob.")],
    output: Annotated[Path, typer.Option(help="Predictor directory to write.")],
    featurizer: Annotated[str, typer.Option(help="hashed or embedding.")] = "hashed",
    checkpoint: Annotated[
        Path, typer.Option(help="Policy directory whose tokenizer wrote the trees.")
    ] = Path("build/policy/calc"),
    resume: Annotated[
        Path | None, typer.Option(help="Continue from this saved predictor (and its replay).")
    ] = None,
    hidden: Annotated[int, typer.Option(help="MLP hidden width (0: logistic).")] = 64,
    epochs: Annotated[int, typer.Option(help="Passes over the training rows.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the weights and batches.")] = 0,
) -> None:
    """Fit the predictor on stored trees and save it (value.safetensors + value.json)."""
    import torch

    from trace_core.bench.predictor import (
        load_policy_tokenizer,
        load_trees,
        tree_paths,
        value_config,
    )
    from trace_core.policy.value import ValuePredictor

    try:
        tokenizer = load_policy_tokenizer(checkpoint)
        paths = tree_paths(trees)
        if resume:
            predictor = ValuePredictor.load(resume, tokenizer=tokenizer)
        else:
            predictor = ValuePredictor(
                value_config(tokenizer, featurizer, hidden, epochs),
                generator=torch.Generator().manual_seed(seed),
                tokenizer=tokenizer,
            )
    except (ValueError, FileNotFoundError) as err:
        raise _fail(str(err)) from None
    with console.status(f"fitting on {len(paths)} files"):
        fit = predictor.fit(load_trees(paths), torch.Generator().manual_seed(seed + 1))
    predictor.save(output)
    console.print(
        f"{fit.rows:,} rows (+{fit.replayed_rows:,} replayed), weighted MSE "
        f"{fit.loss_before:.4f} → {fit.loss_after:.4f} in {fit.seconds:.1f} s; wrote {output}"
    )


def _update_options(
    estimator: str, lr: float, kl_coef: float, clip: float, minibatch: int, epochs: int
) -> UpdateConfigT:
    from trace_core.policy.update import UpdateConfig

    return UpdateConfig(
        estimator=estimator, lr=lr, kl_coef=kl_coef, clip=clip, minibatch=minibatch, epochs=epochs
    )


Estimator = Annotated[str, typer.Option(help="Advantage: grpo, drgrpo, treepo or treerl.")]
LearningRate = Annotated[float, typer.Option(help="AdamW learning rate of the policy update.")]
KLCoef = Annotated[float, typer.Option(help="β of the k3 KL to the starting policy (0: off).")]
Clip = Annotated[float, typer.Option(help="PPO clip range ε.")]
Minibatch = Annotated[int, typer.Option(help="Paths per optimizer step.")]
Epochs = Annotated[int, typer.Option(help="Passes over each iteration's paths.")]
Iterations = Annotated[int, typer.Option(help="K: rollout → predictor → update iterations.")]
RootBudget = Annotated[int, typer.Option(help="M: root rollouts per iteration (tree strategies).")]
Continuations = Annotated[int, typer.Option(help="N: continuations per root.")]
Group = Annotated[int, typer.Option(help="Group size of grpo and pcl.")]
Pool = Annotated[int, typer.Option(help="Candidate prompts drawn per iteration.")]
EvalTasks = Annotated[int, typer.Option(help="Held-out tasks evaluated.")]
EvalK = Annotated[int, typer.Option(help="Samples per task for mean@k.")]
EvalEvery = Annotated[int, typer.Option(help="Evaluate every this many iterations.")]
PredictorKind = Annotated[str, typer.Option(help="Predictor featurizer: hashed or embedding.")]


@app.command("train")
def train_command(
    task: Annotated[str, typer.Option(help="calc, multihop, bfcl, deepscaler or hotpotqa.")] = (
        "calc"
    ),
    data: Annotated[str | None, typer.Option(help="Dataset path/URI (loader tasks).")] = None,
    output: Annotated[Path, typer.Option(help="Run folder (resumes if it holds a run).")] = Path(
        "build/train/calc-trace"
    ),
    init: Annotated[
        Path | None, typer.Option(help="Starting policy (HF dir); default: warm start.")
    ] = None,
    strategy: Annotated[str, typer.Option(help="Allocation strategy.")] = "trace",
    iterations: Iterations = 12,
    budget: RootBudget = 128,
    continuations: Continuations = 2,
    group: Group = 8,
    prompts: Pool = 512,
    estimator: Estimator = "grpo",
    lr: LearningRate = 1e-4,
    kl_coef: KLCoef = 0.0,
    clip: Clip = 0.2,
    minibatch: Minibatch = 64,
    epochs: Epochs = 1,
    eval_tasks: EvalTasks = 300,
    eval_k: EvalK = 4,
    eval_every: EvalEvery = 2,
    predictor: PredictorKind = "hashed",
    seed: Annotated[int, typer.Option(help="Seed of pools, plans, sampling, updates.")] = 0,
    threads: Annotated[int, typer.Option(help="Torch threads (0: torch's default).")] = 0,
    train_workers: Annotated[
        int, typer.Option(help="Ray Train workers for the update (0: in this process).")
    ] = 0,
    ray_address: Annotated[
        str | None, typer.Option(help="Ray head for --train-workers (default: in-process Ray).")
    ] = None,
) -> None:
    """Warm start, then K iterations of rollout → fit predictor → update policy → evaluate."""
    from trace_core.train.loop import TrainConfig, plot_run, train
    from trace_core.train.warmstart import set_threads

    set_threads(threads)
    try:
        config = TrainConfig(
            task=task,
            data=data,
            output=output,
            init=init,
            strategy=strategy,
            iterations=iterations,
            budget=budget,
            continuations=continuations,
            group=group,
            prompts=prompts,
            seed=seed,
            update=_update_options(estimator, lr, kl_coef, clip, minibatch, epochs),
            eval_tasks=eval_tasks,
            eval_k=eval_k,
            eval_every=eval_every,
            predictor=predictor,
            train_workers=train_workers,
            ray_address=ray_address,
        )
        with _progress() as bar:
            job = bar.add_task("training", total=iterations)

            def report(message: str) -> None:
                console.print(message)
                if message.startswith("iteration "):
                    bar.update(job, completed=int(message.split()[1].split("/")[0]))

            records = train(config, progress=report)
    except ValueError as err:
        raise _fail(str(err)) from None
    plot_run(records, output / "curves.png")
    first, last = records[0].eval, next(r.eval for r in reversed(records) if r.eval)
    assert first is not None and last is not None
    table = Table(title=f"{task} · {strategy}: held-out success before and after")
    for head in ("", "pass@1", f"mean@{eval_k}", "generated tokens"):
        table.add_column(head, justify="right")
    table.add_row("start", f"{first['pass1']['all']:.3f}", _mean_k(first), "0")  # type: ignore[index]
    table.add_row(
        f"iteration {records[-1].iteration}",
        f"{last['pass1']['all']:.3f}",  # type: ignore[index]
        _mean_k(last),
        f"{records[-1].total_tokens:,}",
    )
    console.print(table)
    console.print(f"wrote {output}/log.jsonl and {output}/curves.png")


def _mean_k(report: dict[str, object]) -> str:
    values = report["mean_k"]
    return f"{values['all']:.3f}" if values else "-"  # type: ignore[index]


@app.command("compare")
def compare_command(
    task: Annotated[str, typer.Option(help="Synthetic task with a warm start: calc, multihop.")] = (
        "calc"
    ),
    output: Annotated[Path, typer.Option(help="Folder of every run (resumable).")] = Path(
        "build/compare"
    ),
    init: Annotated[
        Path | None, typer.Option(help="Starting policy (HF dir); default: one warm start.")
    ] = None,
    strategies: Annotated[
        str, typer.Option(help="Comma-separated strategies.")
    ] = "trace,grpo,pcl,treepo",
    seeds: Annotated[int, typer.Option(help="Seeds per strategy.")] = 3,
    iterations: Iterations = 12,
    budget: RootBudget = 128,
    continuations: Continuations = 2,
    group: Group = 8,
    prompts: Pool = 512,
    estimator: Estimator = "grpo",
    lr: LearningRate = 1e-4,
    kl_coef: KLCoef = 0.0,
    clip: Clip = 0.2,
    minibatch: Minibatch = 64,
    epochs: Epochs = 1,
    eval_tasks: EvalTasks = 300,
    eval_k: EvalK = 4,
    eval_every: EvalEvery = 2,
    predictor: PredictorKind = "hashed",
    parallel: Annotated[int, typer.Option(help="Runs at once (one process each).")] = 2,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Plot PNG.")] = Path("build/compare.png"),
) -> None:
    """Every strategy from the same warm start, seeds and budget: table, plot, JSON."""
    from trace_core.train.compare import (
        METRICS as COMPARE_METRICS,
    )
    from trace_core.train.compare import (
        CompareConfig,
        plot_compare,
        run_compare,
        write_json,
    )
    from trace_core.train.loop import TrainConfig

    try:
        config = CompareConfig(
            task=task,
            output=output,
            init=init,
            strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
            seeds=seeds,
            parallel=parallel,
            run=TrainConfig(
                task=task,
                iterations=iterations,
                budget=budget,
                continuations=continuations,
                group=group,
                prompts=prompts,
                update=_update_options(estimator, lr, kl_coef, clip, minibatch, epochs),
                eval_tasks=eval_tasks,
                eval_k=eval_k,
                eval_every=eval_every,
                predictor=predictor,
            ),
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    with console.status("training every strategy") as status:
        result = run_compare(config, progress=lambda m: status.update(m))
    table = Table(
        title=f"{task}: {seeds} seeds × {iterations} iterations, M={budget} N={continuations}"
    )
    table.add_column("strategy")
    for metric in COMPARE_METRICS:
        table.add_column(metric.replace("_", " "), justify="right")
    for name, row in result.strategies.items():
        table.add_row(
            name,
            *(
                f"{row[m]['mean']:.3f} ± {row[m]['std']:.3f}"
                if m in row and m != "tokens"
                else (f"{row[m]['mean']:,.0f}" if m in row else "-")
                for m in COMPARE_METRICS
            ),
        )
    console.print(table)
    if json_path:
        write_json(result, json_path)
        console.print(f"wrote {json_path}")
    if plot:
        plot_compare(result, plot)
        console.print(f"wrote {plot}")


# --- trace-rl inspect / bench store: rollout trees on disk or S3 (logic in trace_core/store) ---
inspect_app = typer.Typer(
    help="Rollout trees in a Parquet file, a folder or tree set, or s3://bucket/prefix: "
    "trace-rl inspect COMMAND PATH_OR_URI [ARGS]. S3 credentials come from AWS_* variables."
)
app.add_typer(inspect_app, name="inspect")
_TREES_HELP = "A Parquet file, a folder or tree set, or s3://bucket/prefix."
TreesArg = Annotated[
    str, typer.Argument(help=_TREES_HELP, metavar="PATH_OR_URI", show_default=False)
]
RunOpt = Annotated[str | None, typer.Option(help="Only trees of this run id.")]
IterationOpt = Annotated[int | None, typer.Option(help="Only trees of this iteration.")]
if TYPE_CHECKING:
    from trace_core.store.treeset import TreeSource
# What a store, a schema or a query refuses: StoreError (OSError), SchemaError/ManifestError/
# QueryError (ValueError), TreeNotFound (LookupError). Each message names the URI.
_INSPECT_ERRORS = (OSError, ValueError, LookupError)


def _open_trees(uri: str) -> TreeSource:
    from trace_core.store.treeset import open_trees

    try:
        return open_trees(uri)
    except _INSPECT_ERRORS as err:
        raise _fail(str(err)) from None


@inspect_app.command("summary")
def inspect_summary(
    uri: TreesArg,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the summary here.")] = (
        None
    ),
) -> None:
    """Trees, nodes, strategies, iterations, effective ratios, reward mix, units and tokens."""
    from trace_core.store.inspect import summarize, summary_table

    source = _open_trees(uri)
    try:
        with _progress() as bar:
            job = bar.add_task("reading trees", total=len(source.keys))
            summary = summarize(source, progress=lambda done, _n: bar.update(job, completed=done))
    except _INSPECT_ERRORS as err:
        raise _fail(str(err)) from None
    console.print(summary_table(summary))
    if json_path:
        json_path.write_text(json.dumps(summary.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_path}")


@inspect_app.command("query")
def inspect_query(
    uri: TreesArg,
    sql: Annotated[str, typer.Argument(help="SQL over the view `nodes`, one row per node.")],
    max_rows: Annotated[int, typer.Option(help="Rows printed at most.")] = 50,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write every row (.parquet or .csv).")
    ] = None,
) -> None:
    """DuckDB SQL over the trees; only the columns the query uses are read."""
    from trace_core.store.query import run_query

    if output and output.suffix not in (".parquet", ".csv"):
        raise _fail(f"--output {output}: use a .parquet or .csv file")
    source = _open_trees(uri)
    try:
        with console.status("querying"):
            result = run_query(source, sql)
    except _INSPECT_ERRORS as err:
        raise _fail(str(err)) from None
    table = Table(
        title=f"{result.num_rows:,} rows"
        + (f" (first {max_rows})" if result.num_rows > max_rows else "")
    )
    for name in result.column_names:
        table.add_column(name, overflow="fold")
    for row in result.slice(0, max_rows).to_pylist():
        table.add_row(*(_cell(v) for v in row.values()))
    console.print(table)
    if output:
        import pyarrow.csv
        import pyarrow.parquet as pq

        if output.suffix == ".parquet":
            pq.write_table(result, output)
        else:
            pyarrow.csv.write_csv(result, output)
        console.print(f"wrote {output}")


def _cell(value: object, width: int = 60) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


@inspect_app.command("show")
def inspect_show(
    uri: TreesArg,
    tree_id: Annotated[int, typer.Argument(help="The tree's tree_id.", show_default=False)],
    run: RunOpt = None,
    iteration: IterationOpt = None,
    width: Annotated[int, typer.Option(help="Characters of text per turn (0: all).")] = 80,
) -> None:
    """One tree in the terminal: turns, rewards, predicted V, targets V̂, continuations."""
    from trace_core.store.inspect import find_trees, render_tree

    source = _open_trees(uri)
    try:
        (tree,) = find_trees(source, [tree_id], run=run, iteration=iteration)
    except _INSPECT_ERRORS as err:
        raise _fail(str(err)) from None
    console.print(render_tree(tree, width=width))


@inspect_app.command("html")
def inspect_html(
    uri: TreesArg,
    tree_ids: Annotated[
        list[int] | None, typer.Argument(help="tree_ids to show (default: the first --sample).")
    ] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="HTML file to write.")] = Path(
        "trees.html"
    ),
    run: RunOpt = None,
    iteration: IterationOpt = None,
    sample: Annotated[int, typer.Option(help="Trees shown when no tree_id is given.")] = 5,
    title: Annotated[str | None, typer.Option(help="Page title (default: the source).")] = None,
) -> None:
    """A self-contained HTML tree view (no network): collapsible turns, rewards, V and V̂."""
    from trace_core.store.html import render_html
    from trace_core.store.inspect import find_trees, sample_trees

    source = _open_trees(uri)
    try:
        if tree_ids:
            trees = find_trees(source, tree_ids, run=run, iteration=iteration)
        else:
            trees = sample_trees(source, sample)
    except _INSPECT_ERRORS as err:
        raise _fail(str(err)) from None
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render_html(trees, title=title or f"Rollout trees: {source.uri}"))
    console.print(f"wrote {output} ({len(trees)} trees, {sum(t.size for t in trees):,} nodes)")


@bench_app.command("store")
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

    try:
        config = StoreBenchConfig(trees=trees, query_nodes=query_nodes, repeats=repeats, s3=s3)
    except ValueError as err:
        raise _fail(str(err)) from None
    try:
        with console.status("benchmarking storage") as status:
            result = run_store_bench(config, progress=lambda m: status.update(m))
    except (OSError, RuntimeError) as err:
        raise _fail(str(err)) from None
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
    if json_path:
        result.write_json(json_path)
        console.print(f"wrote {json_path}")


# --- the pipeline: compile, submit and schedule on KFP; Argo manifests without KFP ---------------
pipeline_app = typer.Typer(
    help="The KFP training pipeline: compile, upload, run, schedule, runs; `argo` writes the "
    "Argo WorkflowTemplate and CronWorkflow. The server comes from --host or KFP_HOST, a token "
    "from KFP_TOKEN (never printed)."
)
app.add_typer(pipeline_app, name="pipeline")

KfpHost = Annotated[
    str | None,
    typer.Option(
        envvar=["KFP_HOST", "KF_PIPELINES_ENDPOINT"],
        help="KFP API endpoint, e.g. http://localhost:8080 (env KFP_HOST).",
    ),
]
KfpToken = Annotated[
    str | None,
    typer.Option(
        envvar="KFP_TOKEN",
        help="Bearer token; prefer the KFP_TOKEN variable (flags show in `ps`). Never printed.",
    ),
]
KfpNamespace = Annotated[
    str | None,
    typer.Option(envvar="KFP_NAMESPACE", help="Profile namespace (multi-user KFP only)."),
]
PackagePath = Annotated[
    Path | None,
    typer.Option(
        "--package", help="Compiled pipeline YAML; default: pipelines/compiled/trace_training.yaml."
    ),
]
PipelineName = Annotated[
    str | None, typer.Option(help="Pipeline name on the server; default: the package's name.")
]
RunName = Annotated[
    str,
    typer.Option(
        help="The run_name parameter: the checkpoint run to start or resume from `latest`."
    ),
]
Params = Annotated[
    list[str] | None,
    typer.Option("--param", help="KEY=VALUE pipeline parameter (repeat), typed by the package."),
]
Experiment = Annotated[str, typer.Option(help="KFP experiment (created if missing).")]


if TYPE_CHECKING:
    from pipelines.client import Package, Server


def _submission(
    host: str | None, token: str | None, namespace: str | None, package: Path | None
) -> tuple[Server, Package]:
    from pipelines.client import DEFAULT_PACKAGE, Server, read_package

    return Server.from_env(host, token, namespace), read_package(package or DEFAULT_PACKAGE)


@pipeline_app.command("compile")
def pipeline_compile(
    output: Annotated[
        Path | None,
        typer.Option(help="Where to write the IR YAML; default: pipelines/compiled/."),
    ] = None,
) -> None:
    """Compile the training pipeline to KFP IR YAML (what `upload` and the KFP UI take)."""
    from pipelines.client import DEFAULT_PACKAGE, read_package
    from pipelines.trace_training import compile_pipeline

    output = output or DEFAULT_PACKAGE
    output.parent.mkdir(parents=True, exist_ok=True)
    compile_pipeline(output)
    package = read_package(output)
    console.print(
        f"compiled {package.name} ({len(package.parameters)} parameters: "
        f"{', '.join(sorted(package.parameters))}) to {output}"
    )


@pipeline_app.command("upload")
def pipeline_upload(
    package_path: PackagePath = None,
    name: PipelineName = None,
    version: Annotated[
        str | None, typer.Option(help="Version name; default: UTC time + the package's hash.")
    ] = None,
    description: Annotated[str | None, typer.Option(help="Shown in the KFP UI.")] = None,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """Upload the compiled pipeline; if its name exists on the server, as a new version."""
    from pipelines.client import SubmitError, connect, upload

    try:
        server, package = _submission(host, token, namespace, package_path)
        made = upload(connect(server), server, package, name, version, description)
    except SubmitError as err:
        raise _fail(str(err)) from None
    what = "new pipeline" if made.new_pipeline else "new version"
    console.print(f"{what} {name or package.name!r}: version {made.version_name!r}")
    console.print(f"  pipeline id {made.pipeline_id}, version id {made.version_id}")
    console.print(f"  {server.host}/#/pipelines/details/{made.pipeline_id}")


@pipeline_app.command("run")
def pipeline_run(
    run_name: RunName,
    param: Params = None,
    pipeline: PipelineName = None,
    version: Annotated[
        str | None, typer.Option(help="Version name to run; default: the newest.")
    ] = None,
    experiment: Experiment = "trace-rl",
    display_name: Annotated[
        str | None, typer.Option(help="Run name in the UI; default: RUN_NAME-<UTC time>.")
    ] = None,
    package_path: PackagePath = None,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """Start one run of an uploaded pipeline version with parameters."""
    from pipelines.client import SubmitError, build_params, connect, resolve, run

    try:
        server, package = _submission(host, token, namespace, package_path)
        params = build_params(package, param or [], run_name)
        client = connect(server)
        target = resolve(client, server, pipeline or package.name, version)
        made = run(client, server, target, params, experiment, display_name)
    except SubmitError as err:
        raise _fail(str(err)) from None
    console.print(
        f"started run {made.display_name!r} (id {made.id}) of version {target.version_name!r}"
    )
    console.print(f"  parameters: {json.dumps(params, sort_keys=True)}")
    console.print(f"  {made.url}")


@pipeline_app.command("schedule")
def pipeline_schedule(
    run_name: RunName,
    cron: Annotated[
        str, typer.Option(help="6-field cron, seconds first: '0 0 3 * * *' is 03:00 daily.")
    ],
    param: Params = None,
    name: Annotated[
        str | None, typer.Option(help="Recurring run name; default: RUN_NAME-schedule.")
    ] = None,
    max_concurrency: Annotated[
        int, typer.Option(help="Runs at once (1: a run never overlaps the one resuming it).")
    ] = 1,
    catchup: Annotated[
        bool, typer.Option(help="Backfill every missed slot after a pause (default: only one).")
    ] = False,
    pipeline: PipelineName = None,
    version: Annotated[
        str | None, typer.Option(help="Version name to schedule; default: the newest.")
    ] = None,
    experiment: Experiment = "trace-rl",
    package_path: PackagePath = None,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """A recurring run: each run resumes RUN_NAME from its latest checkpoint."""
    from pipelines.client import SubmitError, build_params, check_cron, connect, resolve, schedule

    try:
        cron = check_cron(cron)
        server, package = _submission(host, token, namespace, package_path)
        params = build_params(package, param or [], run_name)
        client = connect(server)
        target = resolve(client, server, pipeline or package.name, version)
        made = schedule(
            client,
            server,
            target,
            cron,
            params,
            name or f"{run_name}-schedule",
            experiment,
            max_concurrency=max_concurrency,
            no_catchup=not catchup,
        )
    except SubmitError as err:
        raise _fail(str(err)) from None
    console.print(
        f"scheduled {made.display_name!r} (id {made.id}): cron {cron!r}, "
        f"max concurrency {max_concurrency}, catch-up {'on' if catchup else 'off'}; "
        f"each run resumes {run_name!r} from its latest checkpoint"
    )
    console.print(
        f"  version {target.version_name!r}; parameters: {json.dumps(params, sort_keys=True)}"
    )
    console.print(f"  {made.url}")


@pipeline_app.command("runs")
def pipeline_runs(
    experiment: Annotated[
        str | None, typer.Option(help="Only this experiment's runs; default: all.")
    ] = None,
    limit: Annotated[int, typer.Option(help="How many of the newest runs.")] = 20,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """The newest runs: id, name, state, created, the run_name they train, schedule."""
    from pipelines.client import Server, SubmitError, connect, runs

    try:
        server = Server.from_env(host, token, namespace)
        rows = runs(connect(server), server, experiment, limit)
    except SubmitError as err:
        raise _fail(str(err)) from None
    table = Table(title=f"runs on {server.host}" + (f" · {experiment}" if experiment else ""))
    for head in ("run id", "name", "state", "created", "run_name", "recurring run"):
        table.add_column(head)
    for r in rows:
        table.add_row(
            r.run_id, r.display_name, r.state, r.created_at, r.run_name, r.recurring_run_id
        )
    console.print(table)


@pipeline_app.command("argo")
def pipeline_argo(
    output_dir: Annotated[
        Path | None, typer.Option(help="Folder to write; default: manifests/argo/.")
    ] = None,
) -> None:
    """Write the Argo WorkflowTemplate and CronWorkflow (same steps, no KFP) and kustomization."""
    from pipelines.argo import DEFAULT_DIR, write_manifests

    for path in write_manifests(output_dir or DEFAULT_DIR):
        console.print(f"wrote {path}")


# --- the pipeline run here (kfp.local), and one pipeline step (what a Ray job runs) -------------
@app.command("run-local")
def run_local_command(
    output: Annotated[Path, typer.Option(help="Artifacts, links and the registry go here.")] = Path(
        "runs"
    ),
    task: Annotated[str, typer.Option(help="calc, multihop, bfcl, deepscaler or hotpotqa.")] = (
        "calc"
    ),
    strategy: Annotated[str, typer.Option(help="Allocation strategy.")] = "trace",
    iterations: Annotated[int, typer.Option(help="K, unrolled into the pipeline.")] = 6,
    budget: RootBudget = 128,
    continuations: Continuations = 2,
    seed: Annotated[int, typer.Option(help="Seed of pools, plans, sampling, updates.")] = 0,
    run_name: Annotated[
        str, typer.Option(help="Registry name: resume after its latest checkpoint ('' : none).")
    ] = "calc-local",
    store: Annotated[str, typer.Option(help="Registry / staging root; default: OUTPUT/store.")] = (
        ""
    ),
    dataset_uri: Annotated[str, typer.Option(help="Dataset path/URI (loader tasks).")] = "",
    base_model_uri: Annotated[
        str, typer.Option(help="Starting policy (HF dir or s3://); default: warm start.")
    ] = "",
    ray_address: Annotated[
        str, typer.Option(help="Ray dashboard http://HEAD:8265: rollout/update as Ray jobs.")
    ] = "",
    settings_json: Annotated[
        str,
        typer.Option(help="TrainConfig fields (JSON) over make run's: prompts, eval_tasks, ..."),
    ] = "{}",
    s3_endpoint: Annotated[
        str, typer.Option(help="AWS_ENDPOINT_URL_S3 for the steps; default: the environment's.")
    ] = "",
) -> None:
    """The training pipeline through KFP's local runner: the same components as on a cluster."""
    from pipelines.local import MAKE_RUN_SETTINGS, LocalRun, print_result, run_local

    try:
        overrides = json.loads(settings_json)
        if not isinstance(overrides, dict):
            raise ValueError("--settings-json must be a JSON object")
        run = LocalRun(
            output=output,
            task=task,
            strategy=strategy,
            iterations=iterations,
            budget=budget,
            continuations=continuations,
            seed=seed,
            run_name=run_name,
            store=store,
            dataset_uri=dataset_uri,
            base_model_uri=base_model_uri,
            ray_address=ray_address,
            settings={**MAKE_RUN_SETTINGS, **overrides},
            s3_endpoint=s3_endpoint,
        )
        result = run_local(run, say=console.print)
    except (ValueError, RuntimeError) as err:  # a bad setting, or a step that failed
        raise _fail(str(err)) from None
    print_result(result, say=lambda line: console.print(line, highlight=False, soft_wrap=True))


@app.command("step")
def step_command(
    step: Annotated[
        str,
        typer.Argument(
            help="prep, warmstart, load, rollout, fit-predictor, update, evaluate or report.",
            show_default=False,
        ),
    ],
    iteration: Annotated[int, typer.Option(help="Training iteration (from 1; 0 outside).")] = 0,
    config_json: Annotated[
        str, typer.Option(help="The pipeline's config JSON (prep's output; not for prep).")
    ] = "",
    inputs: Annotated[
        list[str] | None,
        typer.Option("--input", help="NAME=PATH_OR_URI of an input folder (repeat)."),
    ] = None,
    outputs: Annotated[
        list[str] | None,
        typer.Option("--output", help="NAME=PATH_OR_URI of an output folder (repeat)."),
    ] = None,
    params: Annotated[
        list[str] | None,
        typer.Option("--param", help="prep only: NAME=VALUE of a run parameter (repeat)."),
    ] = None,
) -> None:
    """One pipeline step on folders or s3:// prefixes: what an Argo container or a Ray job runs."""
    from trace_core.train.steps import execute_cli_step

    def pairs(items: list[str], flag: str) -> dict[str, str]:
        found = {}
        for item in items:
            name, sep, uri = item.partition("=")
            if not sep or not name or not uri:
                raise ValueError(f"{flag} {item!r}: expected NAME=VALUE")
            found[name] = uri
        return found

    try:
        if step != "prep" and not config_json:
            raise ValueError(f"step {step} needs --config-json (prep's config.json)")
        written = pairs(outputs or [], "--output")
        execute_cli_step(
            step,
            iteration,
            pairs(inputs or [], "--input"),
            written,
            config_json,
            pairs(params or [], "--param"),
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    console.print(f"{step} {iteration}: wrote {', '.join(written.values())}")


if __name__ == "__main__":
    app()
