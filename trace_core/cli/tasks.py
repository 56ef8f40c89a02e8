"""Tasks, warm start and rollouts: ``trace-rl task check``, ``warmstart``, ``rollout-demo``,
``prep`` (a task's prompts as Parquet) and ``rollout`` (one budgeted rollout phase).

    trace-rl task check calc
    trace-rl warmstart --task calc --output build/policy/calc
    trace-rl rollout --checkpoint build/policy/calc --strategy trace --budget 64 --workers 2
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trace_core.cli.options import config_options
from trace_core.cli.output import console, expected_errors, fail, progress, write_json
from trace_core.envs.suites import TASK_HELP
from trace_core.rollout.engine_config import EngineConfig

task_app = typer.Typer(help=f"Task suites: {TASK_HELP}")


@task_app.command("check")
def task_check(
    task: Annotated[
        str,
        typer.Argument(help=TASK_HELP),
    ],
    data: Annotated[str | None, typer.Option(help="Dataset path/URI (deepscaler, hotpotqa).")] = (
        None
    ),
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Replay every task's reference solution through its env; 1.0 is expected."""
    from trace_core.envs.suites import check_references, make_suite

    suite = make_suite(task, data)
    with console.status(f"replaying {task} references"):
        report = check_references(suite)
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
    write_json(json_path, report.to_json())


def warmstart_command(
    context: typer.Context,
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
    init: Annotated[
        Path | None,
        typer.Option(help="Pretrained HF directory to fine-tune instead of a fresh tiny policy."),
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """SFT of the tiny policy (or of --init) on scripted demos; prints eval success."""
    from dataclasses import asdict, replace

    from trace_core.policy.checkpoint import check_checkpoint
    from trace_core.policy.sft import SFTConfig
    from trace_core.train.config import PRETRAINED
    from trace_core.train.warmstart import (
        PRETRAINED_SFT,
        WarmstartConfig,
        set_threads,
        stored_warmstart,
        warmstart,
    )

    set_threads(threads)
    sft, max_tokens = SFTConfig(steps=steps, seed=seed), 48
    if init is not None:
        check_checkpoint(init, "--init")
        given = {
            n
            for n in ("steps", "demos")
            if getattr(context.get_parameter_source(n), "name", "DEFAULT") != "DEFAULT"
        }
        sft = replace(PRETRAINED_SFT, seed=seed, **({"steps": steps} if "steps" in given else {}))
        demos = demos if "demos" in given else sft.steps * sft.batch_size
        max_tokens = int(PRETRAINED["max_tokens"])
        console.print(
            f"pretrained --init: {sft.steps} steps of {sft.batch_size} reference episodes at lr "
            f"{sft.lr:g}, {sft.micro_tokens} tokens per pass, {max_tokens}-token turns"
        )
    config = WarmstartConfig(
        task=task,
        output=output,
        seed=seed,
        demos=demos,
        sft=sft,
        eval_tasks=eval_tasks,
        eval_samples=eval_samples,
        init=init,
        max_tokens=max_tokens,
    )
    stored = stored_warmstart(output, config, "this warm start")
    if stored is not None:
        console.print(f"{output} already holds this warm start (same task and recipe): its report")
        report = stored
    else:
        with progress() as bar:
            job = bar.add_task("warm start (SFT)", total=sft.steps)
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
    if report.parse_rate_before is not None:
        console.print(f"action parse rate {report.parse_rate_before:.3f} → {report.parse_rate:.3f}")
        console.print(
            f"held-out success {report.success_all_before:.3f} → {report.success_all:.3f}"
        )
    write_json(json_path, asdict(report))


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
    from trace_core.policy.format import TurnFormat, TurnStyle
    from trace_core.policy.model import load_checkpoint
    from trace_core.policy.torch_engine import TorchEngine
    from trace_core.rollout.flat import rollout_flat
    from trace_core.train.warmstart import (
        WarmstartConfig,
        stored_warmstart,
        synthetic_suite,
        warmstart,
    )

    suite = synthetic_suite(task)
    path = checkpoint or Path(f"build/policy/{task}")
    made = WarmstartConfig(task=task, output=path)
    # A --checkpoint given is the user's to choose; the default one is reused only when it is
    # the warm start this command would make (task and recipe).
    chosen = checkpoint is not None and checkpoint.exists()
    if not chosen and stored_warmstart(path, made, f"rollout-demo --task {task}") is None:
        console.print(f"no policy at {path}: warm-starting one first")
        with console.status("warm start"):
            warmstart(made)
    model, tokenizer = load_checkpoint(path)
    fmt = TurnFormat(tokenizer, TurnStyle(suite.instructions))
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


def prep_command(
    task: Annotated[
        str,
        typer.Option(help=TASK_HELP),
    ] = ("calc"),
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
        raise fail(f"--split must be train or eval, got {split!r}")
    tasks = make_suite(task, data, seed).tasks(split)  # type: ignore[arg-type]
    tasks = tasks[:limit] if limit else tasks
    write_prompts(output, task, tasks)
    console.print(f"wrote {len(tasks)} {task} {split} prompts to {output}")


@config_options(EngineConfig)
def rollout_command(
    config: EngineConfig,
    checkpoint: Annotated[Path, typer.Option(help="Policy directory (HF format).")],
    task: Annotated[
        str,
        typer.Option(help=TASK_HELP),
    ] = ("calc"),
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
    thinking: Annotated[
        bool, typer.Option(help="Qwen3-family thinking (enable_thinking of the chat template).")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the pool, plan and sampling.")] = 0,
    output: Annotated[Path, typer.Option(help="Parquet file of the trees.")] = Path(
        "build/rollout/trees.parquet"
    ),
    metrics: Annotated[Path, typer.Option(help="Metrics JSON.")] = Path(
        "build/rollout/metrics.json"
    ),
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            help="Ray head (host:port) for --workers; default: Ray started in this process.",
        ),
    ] = None,
) -> None:
    """One rollout phase: grow budgeted trees with the policy; write Parquet and metrics."""
    import numpy as np

    from trace_core.algo.plan import Budget
    from trace_core.envs.prompts import read_prompts
    from trace_core.envs.suites import make_suite
    from trace_core.policy.checkpoint import check_checkpoint
    from trace_core.policy.engine import SamplingParams
    from trace_core.policy.format import TurnStyle
    from trace_core.policy.predictor import saved_config
    from trace_core.rollout.grow import GrowConfig
    from trace_core.rollout.phase import run_rollout
    from trace_core.store.schema import write_trees

    if split not in ("train", "eval"):
        raise fail(f"--split must be train or eval, got {split!r}")
    if prompts < 1:
        raise fail(f"--prompts must be >= 1 (candidate prompts in the pool), got {prompts}")
    check_checkpoint(checkpoint, "--checkpoint")
    if predictor_dir and saved_config(predictor_dir) is None:
        raise fail(
            f"--predictor {predictor_dir}: no predictor.json; pass a `trace-rl predictor fit` "
            "folder"
        )
    file_tasks = None
    if prompt_file:
        task, file_tasks = read_prompts(prompt_file)
    suite = make_suite(task, data, seed)
    grow = GrowConfig(
        strategy,
        Budget(budget, continuations, group),
        SamplingParams(max_tokens=max_tokens, temperature=temperature),
        seed=seed,
    )
    tasks = file_tasks if file_tasks is not None else suite.tasks(split)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    pool = [tasks[i] for i in rng.permutation(len(tasks))[:prompts]]
    where = config.engine
    if config.workers:
        where = f"{config.workers} Ray {config.engine} workers, {config.pool_driver} driver"
    with expected_errors(RuntimeError, ConnectionError), progress() as bar:
        job = bar.add_task(f"rollout units ({where})", total=grow.budget.units)
        result = run_rollout(
            checkpoint, pool, suite.make_env, predictor_dir, grow, config, ray_address,
            progress=lambda spent: bar.update(job, completed=spent),
            style=TurnStyle(suite.instructions, thinking),
        )  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    write_trees(output, result.trees)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(
        json.dumps({"strategy": strategy, **result.metrics.as_dict()}, indent=2) + "\n"
    )
    m = result.metrics
    console.print(
        f"{len(result.trees)} trees, {m.units:g} units, {m.tokens:,} tokens; "
        f"prompt effective ratio {m.prompt_effective_ratio:.3f}, "
        f"mixed groups per 100 units {m.mixed_per_100_units:.2f}"
    )
    console.print(f"engines: {where}")
    console.print(f"wrote {output} and {metrics}")
