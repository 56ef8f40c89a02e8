"""``trace-rl bench scale|scale-calibrate|iteration-cost``: the capacity model of the rollout
cluster, on the ``bench`` command group (``cli.bench``). docs/scaling.md is its guide.

    trace-rl bench scale-calibrate --checkpoint build/policy/calc --trees build/scale/trees.parquet
    trace-rl bench scale --trees build/scale/trees.parquet --profile build/scale/cpu-profile.json
    trace-rl bench scale --trees build/scale/trees.parquet --profile h100-8b-vllm --copies 16
    trace-rl bench iteration-cost --trees build/scale/trees.parquet
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trace_core.cli.bench import app
from trace_core.cli.output import console, fail, write_json

WORKERS = "1,2,8,64,256"


@app.command("scale")
def bench_scale(
    trees: Annotated[
        str, typer.Option(help="Parquet trees of one iteration: a directory, a file or a glob.")
    ],
    profile: Annotated[
        str,
        typer.Option(
            help="Cost profile: a JSON from `bench scale-calibrate`, or h100-1.7b-vllm, "
            "h100-8b-vllm, h100-14b-vllm (public figures)."
        ),
    ],
    workers: Annotated[str, typer.Option(help="Worker counts, comma-separated.")] = WORKERS,
    variants: Annotated[str, typer.Option(help="Variants, comma-separated (default: all).")] = "",
    task: Annotated[
        str, typer.Option(help="Task whose env times the trees' env steps ('' for none).")
    ] = "calc",
    env_seconds: Annotated[
        float | None, typer.Option(help="Every env step takes this many seconds instead.")
    ] = None,
    copies: Annotated[int, typer.Option(help="Copies of the tree set (more prompts).")] = 1,
    token_scale: Annotated[float, typer.Option(help="Every token count × this.")] = 1.0,
    measured: Annotated[
        Path | None,
        typer.Option(help="A `bench workers --json` file: predicted vs measured tokens/s."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of random routing.")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of makespan and use.")] = None,
) -> None:
    """One rollout iteration simulated on W workers per scheduling variant: makespan, worker
    utilisation, tokens/s and cache hits, against the baseline (trace) and flat GRPO."""
    from trace_core.bench.predictor import tree_paths
    from trace_core.bench.scale import ScaleBenchConfig, load_profile, run_scale_bench
    from trace_core.bench.scale_sim import VARIANTS

    try:
        counts = tuple(int(w) for w in workers.split(","))
    except ValueError:
        raise fail(f"--workers must be integers separated by commas, got {workers!r}") from None
    names = tuple(v.strip() for v in variants.split(",") if v.strip()) or tuple(
        v.name for v in VARIANTS
    )
    config = ScaleBenchConfig(
        tree_paths(trees),
        load_profile(profile),
        workers=counts,
        variants=names,
        task=task or None,
        env_seconds=env_seconds,
        copies=copies,
        token_scale=token_scale,
        seed=seed,
    )
    reference = json.loads(measured.read_text()) if measured else None
    start = time.perf_counter()
    with console.status("simulating"):
        result = run_scale_bench(config, reference)
    seconds = time.perf_counter() - start
    s = result.stream
    console.print(
        f"{s['trees']:.0f} trees, {s['turns']:,.0f} turns ({s['stage2_turns']:,.0f} in stage 2), "
        f"{s['generated_tokens']:,.0f} generated tokens; profile {config.profile.name}: "
        f"{config.profile.source}",
        highlight=False,
    )
    ratios = result.ratios()
    for name in names:
        table = Table(title=f"{name}: one iteration on W workers")
        heads = ("W", "makespan s", "use", "tokens/s", "cache-hit tok", "prefill tok", "calls")
        for head in (*heads, "÷ trace", "÷ grpo", "speed-up vs W=min"):
            table.add_column(head, justify="right")
        for r in (r for r in result.runs if r.variant == name):
            q = ratios[f"{name} W={r.workers}"]
            table.add_row(
                f"{r.workers}", f"{r.makespan_s:.3g}", f"{r.utilisation:.2f}",
                f"{r.tokens_per_s:,.0f}", f"{r.cache_hit_tokens:,}", f"{r.prefill_tokens:,}",
                f"{r.engine_calls:,}", _times(q.get("vs_trace")), _times(q.get("vs_grpo")),
                _times(q["speedup"]),
            )  # fmt: skip
        console.print(table)
    if result.validation:
        table = Table(title=f"predicted ({config.profile.name}) vs measured ({measured})")
        for head in ("run", "measured tok/s", "predicted tok/s", "error", "busy meas.", "pred."):
            table.add_column(head, justify="right")
        for v in result.validation:
            table.add_row(
                v.run, f"{v.measured_tokens_per_s:,.0f}", f"{v.predicted_tokens_per_s:,.0f}",
                f"{v.error:+.1%}", f"{v.measured_busy:.2f}", f"{v.predicted_busy:.2f}",
            )  # fmt: skip
        console.print(table)
    console.print(f"simulated {len(result.runs)} runs in {seconds:.1f} s")
    write_json(json_path, result.to_json())
    if plot:
        plot_scale(result.to_json(), plot)
        console.print(f"wrote {plot}")


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def plot_scale(data: dict[str, object], path: Path) -> None:
    """Makespan and utilisation against W, one line per variant (log W)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[dict[str, float]] = data["runs"]  # type: ignore[assignment]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(str(r["variant"]) for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        w = [r["workers"] for r in mine]
        axes[0].plot(w, [r["makespan_s"] for r in mine], marker="o", label=name)
        axes[1].plot(w, [r["utilisation"] for r in mine], marker="o", label=name)
    for ax, label in ((axes[0], "makespan (s)"), (axes[1], "worker utilisation")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engine workers W")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    profile: dict[str, object] = data["config"]["profile"]  # type: ignore[index]
    fig.suptitle(f"one rollout iteration, profile {profile['name']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command("scale-calibrate")
def bench_scale_calibrate(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    trees: Annotated[Path, typer.Option(help="Write the workload's trees here (Parquet).")] = Path(
        "build/scale/trees.parquet"
    ),
    output: Annotated[Path, typer.Option(help="Write the fitted profile here (JSON).")] = Path(
        "build/scale/cpu-profile.json"
    ),
    prompts: Annotated[int, typer.Option(help="Candidate prompts (as bench workers).")] = 256,
    budget: Annotated[int, typer.Option(help="M: root rollouts (as bench workers).")] = 256,
    continuations: Annotated[int, typer.Option(help="N: continuations per root.")] = 2,
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 48,
    real_calls: Annotated[
        bool, typer.Option(help="Fit on a rollout's engine calls too, not only synthetic ones.")
    ] = True,
    transport: Annotated[
        bool, typer.Option(help="Time Ray round trips (starts an in-process Ray).")
    ] = True,
) -> None:
    """Fit the CPU cost model of `bench scale` here: TorchEngine prefill and decode vs batch
    size, the driver's turn and Ray's round trip; grow the `bench workers` workload's trees."""
    from trace_core.bench.scale_calibrate import CalibrationConfig, calibrate
    from trace_core.bench.workers import WorkersBenchConfig
    from trace_core.policy.checkpoint import check_checkpoint

    check_checkpoint(checkpoint, "--checkpoint")
    workload = WorkersBenchConfig(
        checkpoint,
        prompts=prompts,
        roots=budget,
        continuations=continuations,
        max_tokens=max_tokens,
    )
    config = CalibrationConfig(
        checkpoint, trees, workload, real_calls=real_calls, transport=transport
    )
    with console.status("calibrating") as status:
        profile, grown = calibrate(config, progress=lambda msg: status.update(msg))
    table = Table(title=f"cost model of one worker: {profile.name}")
    table.add_column("parameter")
    table.add_column("seconds", justify="right")
    for key, value in vars(profile.cost).items():
        table.add_row(key, f"{value:.3g}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"wrote {len(grown)} trees to {trees}")
    write_json(output, profile.to_json())


@app.command("iteration-cost")
def bench_iteration_cost(
    trees: Annotated[str, typer.Option(help="Parquet trees whose shape the rollout takes.")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Per-iteration pipeline cost for Qwen3 1.7B/8B/14B on their recommended cluster shapes,
    with the state handed through S3 and resident on the cluster: S3 bytes, weight loads, pod
    start-up and image pulls against rollout and update time; then the resident iteration at
    max_staleness k = 0, 1, 2 (rollout beside the update) and its speed-up over k = 0; and the
    transport each transfer takes (NCCL over NVLink within a node or over the network, S3),
    from where the run's devices land."""
    from trace_core.bench.iteration_cost import (
        SHAPES,
        STALENESS,
        run_iteration_cost,
        staleness_costs,
    )
    from trace_core.bench.predictor import tree_paths

    with console.status("simulating each model's rollout"):
        rows = run_iteration_cost(tree_paths(trees))
    table = Table(title="one training iteration (assumptions and sources: docs/scaling.md)")
    heads = (
        "model", "design", "workers × GPUs", "M × N", "policy GB", "S3 GB moved", "S3 s",
        "weights s",
        "pods s", "rollout s", "use", "update s", "iteration s", "outside share", "1st pull s",
    )  # fmt: skip
    for head in heads:
        table.add_column(head, justify="right")
    for r in rows:
        shape = SHAPES[r.model]
        table.add_row(
            f"Qwen3-{r.model.upper()}", r.design, f"{shape.workers} × {shape.gpus_per_worker}",
            f"{r.roots} × {r.continuations:.1f}", f"{r.policy_bytes / 1e9:.1f}",
            f"{r.s3_bytes / 1e9:.0f}", f"{r.s3_s:.0f}", f"{r.reload_s:.0f}", f"{r.pods_s:.0f}",
            f"{r.rollout_s:.0f}", f"{r.rollout_utilisation:.2f}", f"{r.update_s:.0f}",
            f"{r.total_s:.0f}", f"{r.outside_share:.0%}", f"{r.image_pull_s:.0f}",
        )  # fmt: skip
    console.print(table)
    table = Table(
        title="each transfer's transport, from where the run's devices land (the trainers on "
        "one node while they fit, the engines beside them, then on further nodes)"
    )
    for head in ("model", "design", "transfer", "GB", "transport", "from → to"):
        table.add_column(head, justify="left" if head in ("transport", "from → to") else "right")
    for r in rows:
        for t in r.transfers:
            table.add_row(
                f"Qwen3-{r.model.upper()}",
                r.design,
                t.name,
                f"{t.bytes / 1e9:.1f}",
                t.transport,
                t.where,
            )
    console.print(table)
    stale = staleness_costs(rows)
    table = Table(
        title="resident, max_staleness k: one iteration in steady state (docs/scaling.md)"
    )
    heads = ("model", "rollout s", "fit s", "update s", "sync s", "pod + trees s")
    for head in (*heads, "checkpoint s k=0 / k≥1", *(f"k={k} s" for k in STALENESS), "k≥1 bound"):
        table.add_column(head, justify="right")
    for k in STALENESS[1:]:
        table.add_column(f"k={k} ÷ k=0", justify="right")
    for c in stale:
        cells = (c.rollout_s, c.fit_s, c.update_s, c.sync_s, c.fixed_s)
        table.add_row(
            f"Qwen3-{c.model.upper()}",
            *(f"{x:.1f}" for x in cells),
            " / ".join(f"{c.checkpoint_s(k):.1f}" for k in (0, 1)),
            *(f"{c.iteration_s(k):.1f}" for k in STALENESS),
            c.bound,
            *(_times(c.speedup(k)) for k in STALENESS[1:]),
        )
    console.print(table)
    write_json(
        json_path,
        {"rows": [r.to_json() for r in rows], "staleness": [c.to_json() for c in stale]},
    )
