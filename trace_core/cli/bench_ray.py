"""``trace-rl bench workers|reload|handoff|async|gpu``: the benchmarks of Ray engine actors,
trainer actors and GPUs, on the ``bench`` command group (``cli.bench``).

    trace-rl bench workers --checkpoint build/policy/calc --engines torch,vllm
    trace-rl bench reload --checkpoint build/policy/calc --engines torch,vllm
    trace-rl bench async --checkpoint build/policy/calc --iterations 6 --staleness 0,1,2
    trace-rl bench gpu --json build/gpu-check.json     # or: bash scripts/gpu_check.sh
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trace_core.cli.bench import app
from trace_core.cli.output import console, fail, write_json


@app.command("gpu")
def bench_gpu(
    smoke: Annotated[bool, typer.Option(help="Every stage on CPU at tiny shapes.")] = False,
    json_path: Annotated[Path, typer.Option("--json", help="Write the stages here.")] = Path(
        "build/gpu-check.json"
    ),
) -> None:
    """The GPU check's stages, each pass/fail against its threshold (what
    scripts/gpu_check.sh runs, without this command line's dependencies)."""
    from trace_core.bench.gpu_check import main

    code = main([*(["--smoke"] if smoke else []), "--json", str(json_path)])
    if code:
        raise fail(f"the GPU check ended with {code}: see the stages above and {json_path}")


@app.command("workers")
def bench_workers(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    prompts: Annotated[int, typer.Option(help="Candidate prompts in the pool.")] = 256,
    budget: Annotated[int, typer.Option(help="M: root rollouts.")] = 256,
    continuations: Annotated[int, typer.Option(help="N: continuations per root.")] = 2,
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 48,
    repeats: Annotated[int, typer.Option(help="Timed runs per engine; the best counts.")] = 3,
    engines: Annotated[
        str, typer.Option(help="Engine kinds of the workers, comma-separated: torch, hf, vllm.")
    ] = "torch",
    eager: Annotated[bool, typer.Option(help="vLLM: no torch.compile (starts faster).")] = False,
    kv_cache_gib: Annotated[
        float, typer.Option(help="vLLM: KV cache per engine in GiB (0: vLLM's default).")
    ] = 0.0,
    cache_tokens: Annotated[
        int, typer.Option(help="TorchEngine: prefix-cache slots per engine.")
    ] = 65_536,
    drivers: Annotated[
        str,
        typer.Option(help="Drivers of each pool, comma-separated: lock-step, async, continuous."),
    ] = "lock-step,async,continuous",
    env_seconds: Annotated[
        float, typer.Option(help="Every env step also waits this long (a tool's latency).")
    ] = 0.0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Rollout tokens/s with 1 and 2 Ray engine workers (one torch thread each), per engine kind
    and driver, and the ratios (2 workers over 1; each kind over the first; async over
    lock-step; continuous over async)."""
    from trace_core.bench.workers import WorkersBenchConfig, run_workers_bench

    try:
        config = WorkersBenchConfig(
            checkpoint,
            prompts=prompts,
            roots=budget,
            continuations=continuations,
            max_tokens=max_tokens,
            repeats=repeats,
            engines=engine_kinds(engines),
            eager=eager,
            kv_cache_gib=kv_cache_gib,
            cache_tokens=cache_tokens,
            drivers=tuple(d.strip() for d in drivers.split(",") if d.strip()),
            env_seconds=env_seconds,
        )
    except ValueError as err:
        raise fail(f"--engines/--drivers/--env-seconds/...: {err}") from None
    with console.status("timing rollouts") as status:
        result = run_workers_bench(config, progress=lambda msg: status.update(msg))
    tool = f", env steps + {env_seconds * 1e3:g} ms" if env_seconds else ""
    table = Table(
        title=f"trace on calc: M={budget} roots × N={continuations}, {prompts} prompts{tool}"
    )
    heads = (
        "engine", "tokens/s", "tokens", "seconds", "calls", "idle", "imbalance", "moved", "rows",
        "rows p95",
    )  # fmt: skip
    for head in heads:
        table.add_column(head, justify="right")
    for r in result.runs:
        table.add_row(
            r.engine,
            f"{r.tokens_per_s:,.0f}",
            f"{r.generated_tokens:,}",
            f"{r.seconds:.2f}",
            f"{r.engine_calls}",
            f"{r.idle_share:.2f}",
            f"{r.imbalance_share:.2f}",
            f"{r.affinity_moved}",
            f"{r.rows_in_flight:.1f}",
            f"{r.rows_p95:.0f}",
        )
    console.print(table)
    for name, ratio in result.ratios().items():
        console.print(f"{name}: {ratio:.2f}×")
    console.print(
        f"load average {result.load_average[0]:.1f} → {result.load_average[1]:.1f} "
        f"on {result.cpus} CPUs"
    )
    write_json(json_path, result.to_json())


@app.command("reload")
def bench_reload(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    engines: Annotated[
        str, typer.Option(help="Engine kinds, comma-separated: torch, hf, vllm.")
    ] = "torch",
    repeats: Annotated[int, typer.Option(help="Timed starts and reloads; the best counts.")] = 3,
    eager: Annotated[bool, typer.Option(help="vLLM: no torch.compile (starts faster).")] = False,
    kv_cache_gib: Annotated[
        float, typer.Option(help="vLLM: KV cache in GiB (0: vLLM's default).")
    ] = 0.0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """New weights into a running Ray engine actor vs starting one afresh, and the ratio."""
    from trace_core.bench.reload import ReloadBenchConfig, run_reload_bench

    try:
        config = ReloadBenchConfig(
            checkpoint,
            engines=engine_kinds(engines),
            repeats=repeats,
            eager=eager,
            kv_cache_gib=kv_cache_gib,
        )
    except ValueError as err:
        raise fail(f"--engines/--repeats: {err}") from None
    with console.status("timing engine starts and reloads") as status:
        result = run_reload_bench(config, progress=lambda msg: status.update(msg))
    table = Table(title=f"new weights into one Ray engine actor: {checkpoint}")
    for head in ("engine", "fresh start s", "reload s", "fresh / reload"):
        table.add_column(head, justify="right")
    for r in result.runs:
        fresh, reload = f"{r.fresh_seconds:.2f}", f"{r.reload_seconds:.2f}"
        table.add_row(r.engine, fresh, reload, f"{r.ratio:.1f}×")
    console.print(table)
    write_json(json_path, result.to_json())


@app.command("handoff")
def bench_handoff(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    iterations: Annotated[int, typer.Option(help="Iterations per mode.")] = 3,
    engines: Annotated[int, typer.Option(help="Engine actors (TorchEngine).")] = 1,
    trainers: Annotated[int, typer.Option(help="Trainer actors (DDP over gloo).")] = 1,
    budget: Annotated[int, typer.Option(help="M: root rollouts per iteration.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 16,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """The same iterations with the training state resident on Ray and handed through S3
    (a SeaweedFS on 127.0.0.1): S3 bytes, weight-sync and iteration seconds, and the ratios."""
    from trace_core.bench.handoff import GOALS, HandoffBenchConfig, run_handoff_bench

    if iterations < 2 or min(engines, trainers, budget, max_tokens) < 1:
        raise fail("--iterations must be >= 2 and --engines/--trainers/--budget >= 1")
    config = HandoffBenchConfig(checkpoint, iterations, engines, trainers, budget=budget,
                                max_tokens=max_tokens)  # fmt: skip
    with console.status("handoff bench") as status:
        result = run_handoff_bench(config, progress=lambda msg: status.update(msg))
    table = Table(title=f"resident vs S3 handoff: {checkpoint} ({result.policy_bytes:,} B policy)")
    for head in ("mode", "iteration", "S3 MB", "S3 / policy", "sync s", "iteration s", "ckpt"):
        table.add_column(head, justify="right")
    for mode, figures in result.modes.items():
        for f in figures:
            table.add_row(
                mode, str(f.iteration), f"{f.s3_bytes / 1e6:.2f}",
                f"{f.s3_bytes / result.policy_bytes:.3f}", f"{f.sync_seconds:.3f}",
                f"{f.iteration_seconds:.2f}", "yes" if f.checkpoint else "",
            )  # fmt: skip
    console.print(table)
    ratios = result.ratios()
    console.print(
        f"resident iterations without a checkpoint: S3 bytes {ratios['s3_share']:.4f} of the "
        f"policy (goal <= {GOALS['s3_share']}); sync {ratios['sync_speedup']:.1f}× faster than "
        f"the S3 reload (goal >= {GOALS['sync_speedup']:g}×); iteration "
        f"{ratios['iteration_speedup']:.2f}× faster (goal >= {GOALS['iteration_speedup']:g}×)"
    )
    write_json(json_path, result.as_dict())


@app.command("async")
def bench_async(
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    iterations: Annotated[int, typer.Option(help="Iterations per run.")] = 4,
    staleness: Annotated[
        str, typer.Option(help="The max_staleness values to run, comma-separated (with 0).")
    ] = "0,1,2",
    task: Annotated[str, typer.Option(help="Task suite of the prompts.")] = "calc",
    budget: Annotated[int, typer.Option(help="M: root rollouts per iteration.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 48,
    trainers: Annotated[int, typer.Option(help="Trainer actors.")] = 1,
    engines: Annotated[int, typer.Option(help="Engine actors (TorchEngine).")] = 1,
    threads: Annotated[int, typer.Option(help="Torch threads of each actor.")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """One training run per max_staleness on one Ray head: seconds per iteration, the
    engines' and trainers' idle shares and the staleness seen, against k = 0."""
    from trace_core.bench.async_schedule import run_async_bench
    from trace_core.policy.checkpoint import check_checkpoint

    check_checkpoint(checkpoint, "--checkpoint")
    try:
        ks = [int(k) for k in staleness.split(",") if k.strip()]
    except ValueError:
        raise fail(f"--staleness: comma-separated integers, got {staleness!r}") from None
    with console.status("bench async") as status:
        try:
            result = run_async_bench(
                checkpoint,
                ks,
                iterations,
                task,
                budget,
                max_tokens=max_tokens,
                trainers=trainers,
                engines=engines,
                threads=threads,
                say=lambda message: status.update(message),
            )
        except ValueError as err:
            raise fail(str(err)) from None
    table = Table(
        title=f"{checkpoint.name}: {trainers} trainer and {engines} engine actor(s), "
        f"{threads} thread(s) each, {iterations} iterations of M = {budget}",
        caption="seconds per iteration: without evaluation, over the iterations after the "
        "largest k, the same for every k (fill: the first iteration's, with the start's k extra "
        "rollouts); idle: share of the iterations' time; speedup: k = 0's seconds over this "
        "k's, in this command.",
    )
    heads = ("k", "s / iteration", "fill s", "engines idle", "trainers idle", "staleness")
    for head in (*heads, "speedup vs 0"):
        table.add_column(head, justify="right")
    for k, figures in result["runs"].items():  # type: ignore[attr-defined]
        seen = " ".join(str(s) for s in figures["staleness"])
        table.add_row(
            k,
            f"{figures['seconds_per_iteration']:.2f}",
            f"{figures['fill_seconds']:.2f}",
            f"{figures['engine_idle_share']:.0%}",
            f"{figures['trainer_idle_share']:.0%}",
            seen,
            f"{figures['speedup_vs_0']:.2f}×",
        )
    console.print(table)
    write_json(json_path, result)


def engine_kinds(text: str) -> tuple[str, ...]:
    """``--engines torch,vllm`` as the configs take it (checked there)."""
    return tuple(kind.strip() for kind in text.split(",") if kind.strip())
