"""Training: ``trace-rl train`` (one run, resumable), ``trace-rl compare`` (every strategy from
one start), ``trace-rl predictor fit``. Their flags are ``TrainConfig``'s fields (and its
``update`` and ``engine`` configs'), declared once there.

    trace-rl train --task calc --strategy trace --iterations 12 --output build/train/calc-trace
    trace-rl compare --task calc --seeds 3 --iterations 10 --json build/compare.json
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from trace_core.cli.options import config_options
from trace_core.cli.output import console, fail, progress, read_json, write_json
from trace_core.train.config import TrainConfig

if TYPE_CHECKING:
    pass

DEFAULT_STRATEGIES = "trace,grpo,pcl,treepo"  # compare.DEFAULT_STRATEGIES, without its imports

predictor_app = typer.Typer(help="The shared success predictor V(prefix): fit it on stored trees.")


@config_options(TrainConfig, types={"init": str | None})  # str: a Path folds s3:// to s3:/
def train_command(
    config: TrainConfig,
    context: typer.Context,
    threads: Annotated[int, typer.Option(help="Torch threads (0: torch's default).")] = 0,
    restart: Annotated[
        bool,
        typer.Option(
            "--restart",
            help="Discard the run already in --output (iterations, log, warm start) and start "
            "anew; without it a run resumes, and a folder it cannot resume is refused.",
        ),
    ] = False,
) -> None:
    """Warm start, then K iterations of rollout → fit predictor → update policy → evaluate."""
    from trace_core.train.evaluate import paired_change
    from trace_core.train.loop import train
    from trace_core.train.warmstart import set_threads

    set_threads(threads)
    config = _pretrained_defaults(config, context)
    output, task, strategy, eval_k = config.output, config.task, config.strategy, config.eval_k
    with progress() as bar:
        job = bar.add_task("training", total=config.iterations)

        def report(message: str) -> None:
            console.print(message)
            if message.startswith("iteration "):
                bar.update(job, completed=int(message.split()[1].split("/")[0]))

        records = train(config, progress=report, restart=restart)
    first, last = records[0].eval, next(r.eval for r in reversed(records) if r.eval)
    assert first is not None and last is not None
    table = Table(title=f"{task} · {strategy}: held-out success before and after")
    for head in ("", "pass@1", f"mean@{eval_k}", "action parse rate", "generated tokens"):
        table.add_column(head, justify="right")
    for label, result, tokens in (
        ("start", first, 0),
        (f"iteration {records[-1].iteration}", last, records[-1].total_tokens),
    ):
        parsed = result.get("parse_rate")  # absent from logs written before it was recorded
        table.add_row(
            label,
            f"{result['pass1']['all']:.3f}",  # type: ignore[index]
            _mean_k(result),
            f"{parsed:.3f}" if isinstance(parsed, float) else "-",
            f"{tokens:,}",
        )
    pass1, mean_k = (paired_change(first, last, m) for m in ("pass1", "mean_k"))
    if pass1 is not None:
        table.add_row(
            "change (95% interval)", pass1.text(), mean_k.text() if mean_k else "-", "", ""
        )
        table.caption = (
            f"change: final − start, each of the {pass1.tasks} tasks against itself; an "
            "interval holding 0 shows no change either way"
        )
    console.print(table)
    console.print(f"wrote {output}/log.jsonl, {output}/curves.png and {output}/summary.md")


def _pretrained_defaults(config: TrainConfig, context: typer.Context) -> TrainConfig:
    """An ``--init`` with a pretrained tokenizer (not the tiny policy's word-level one) gets
    ``PRETRAINED``'s lr, turn length, pass size (and warm-start steps) unless their flags were
    given."""
    from trace_core.policy.format import is_word_tokenizer
    from trace_core.train.base_model import source_tokenizer
    from trace_core.train.config import PRETRAINED, with_pretrained_defaults

    if config.init is None or is_word_tokenizer(source_tokenizer(config.init, "--init")):
        return config
    # By name: typer's context carries its own click's ParameterSource enum.
    explicit = {
        name
        for name in PRETRAINED
        if getattr(context.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"
    }
    config, notes = with_pretrained_defaults(config, explicit)
    for note in notes:
        console.print(
            f"pretrained --init: {note}; set it with --{note.split()[0].replace('_', '-')}"
        )
    return config


def _mean_k(report: dict[str, object]) -> str:
    values = report["mean_k"]
    return f"{values['all']:.3f}" if values else "-"  # type: ignore[index]


def _interval_text(
    stats: dict[str, float] | None, whole: bool = False, signed: bool = False
) -> str:
    """``0.612 [0.580, 0.644]``; one seed: the mean alone; never reached: ``never (n seeds
    reached)``."""
    if stats is None:
        return "-"
    from trace_core.train.compare import bounds

    mean, (low, high) = stats["mean"], bounds(stats)
    if mean is not None and math.isnan(mean):
        return "-"
    if mean is None or math.isinf(mean):
        return f"never ({int(stats['n'])} seeds reached)"
    form = ",.0f" if whole else ("+.3f" if signed else ".3f")
    if low is None or not math.isfinite(low):
        return format(mean, form)
    return f"{mean:{form}} [{low:{form}}, {high:{form}}]"


COMPARE_SKIP = {
    *("data", "output", "init", "strategy", "seed", "train_workers", "engine", "ray_address"),
}
"""Fields a comparison sets itself: every run starts from one policy, with its own seed and
strategy, in a folder of its own, in one process each."""


@config_options(TrainConfig, skip=COMPARE_SKIP)
def compare_command(
    run: TrainConfig,
    output: Annotated[Path, typer.Option(help="Folder of every run (resumable).")] = Path(
        "build/compare"
    ),
    init: Annotated[
        Path | None, typer.Option(help="Starting policy (HF dir); default: one warm start.")
    ] = None,
    strategies: Annotated[
        str, typer.Option(help="Comma-separated strategies.")
    ] = DEFAULT_STRATEGIES,
    seeds: Annotated[int, typer.Option(help="Seeds per strategy.")] = 3,
    first_seed: Annotated[
        int, typer.Option(help="The first seed: runs seeds FIRST_SEED .. FIRST_SEED+SEEDS-1.")
    ] = 0,
    parallel: Annotated[int, typer.Option(help="Runs at once (one process each).")] = 2,
    staleness: Annotated[
        str,
        typer.Option(
            help="Comma-separated max_staleness values k, 0 among them: every strategy runs "
            "once per k (trace, trace@k1, ...), each k >= 1 paired against its k = 0 arm.",
        ),
    ] = "0",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Plot PNG.")] = Path("build/compare.png"),
    paper_table: Annotated[
        str | None,
        typer.Option(
            "--table",
            help="Run one of the paper's tables instead of --strategies: ablation (which stage "
            "adds what) or shape (the budget's shape M×N), printed beside the paper's figures.",
        ),
    ] = None,
    markdown: Annotated[
        Path | None,
        typer.Option(help="Write the tables as Markdown here (with --table: that table)."),
    ] = None,
    from_json: Annotated[
        Path | None,
        typer.Option(
            help="Print (and --markdown, --plot) the tables of a stored --json result instead "
            "of training anything."
        ),
    ] = None,
) -> None:
    """Every strategy from the same warm start, seeds and budget: table, plot, JSON.

    A strategy may carry its own budget shape: trace@64x6 is trace with M=64 roots and N=6
    continuations per root; and its own max_staleness: trace@k1."""
    from trace_core.train.compare import METRICS as COMPARE_METRICS
    from trace_core.train.compare import (
        PAIRED,
        CompareConfig,
        CompareResult,
        plot_compare,
        run_compare,
    )
    from trace_core.train.run_folder import write_atomic
    from trace_core.train.tables import markdown as table_markdown
    from trace_core.train.tables import summary_markdown, table_arms

    if from_json is not None:
        try:
            result = CompareResult.from_json(read_json(from_json, "--from-json"))
        except (KeyError, TypeError, ValueError) as err:
            raise fail(f"--from-json {from_json}: not a compare --json result ({err})") from None
        stored = result.config["run"]
        assert isinstance(stored, dict)
        budget, continuations = int(stored["budget"]), int(stored["continuations"])
        iterations, task = int(stored["iterations"]), str(result.config["task"])
        first_seed, seeds = result.seeds
        if paper_table is not None:
            missing = set(table_arms(paper_table, budget)) - set(result.strategies)
            if missing:
                raise fail(
                    f"--from-json {from_json}: holds no {', '.join(sorted(missing))}: "
                    f"not a --table {paper_table} result"
                )
    else:
        arms = tuple(s.strip() for s in strategies.split(",") if s.strip())
        ks = _staleness_values(staleness)
        if paper_table is not None:
            if strategies != DEFAULT_STRATEGIES:
                raise fail("--table runs its own strategies: leave out --strategies")
            if ks != (0,):
                raise fail("--table runs its own arms: leave out --staleness")
            arms = table_arms(paper_table, run.budget)
        config = CompareConfig(
            task=run.task,
            output=output,
            init=init,
            strategies=arms,
            seeds=seeds,
            first_seed=first_seed,
            parallel=parallel,
            run=run,
            staleness=ks,
        )
        with console.status("training every strategy") as status:
            result = run_compare(config, progress=lambda m: status.update(m))
        budget, continuations, iterations, task = (
            run.budget, run.continuations, run.iterations, run.task
        )  # fmt: skip
    last = first_seed + seeds - 1
    table = Table(
        title=f"{task}: seeds {first_seed}..{last} × {iterations} iterations, "
        f"M={budget} N={continuations}: mean [95% interval]",
        caption="95% intervals: Student t over seeds. accuracy: held-out mean@k; pass1: greedy. "
        "effective ratios: share of prompts (anchors: sibling groups) whose rollouts hold both "
        "rewards. tokens to grpo final: tokens to reach grpo's final accuracy ÷ grpo's tokens "
        "(same seed; below 1: sooner). root skill: the predictor's Brier skill on each "
        "iteration's new prompts before it trained on them (above 0: it ranks them better "
        "than a constant); eval root skill: the same on the held-out prompts, against their "
        "sampled outcomes.",
    )
    table.add_column("strategy")
    for metric in COMPARE_METRICS:
        table.add_column(metric.replace("_", " "), justify="right")
    for name, row in result.strategies.items():
        table.add_row(name, *(_interval_text(row.get(m), m == "tokens") for m in COMPARE_METRICS))
    blocks = (
        (result.paired, "against grpo, seed by seed: strategy − grpo", "strategy"),
        (result.paired_staleness, "against k = 0, seed by seed: arm − the same strategy", "arm"),
    )
    for paired, title, label in blocks:
        if paired:
            console.print(table)
            table = Table(
                title=f"paired {title}, mean [95% interval]",
                caption="An interval that holds 0 is no evidence of a difference.",
            )
            table.add_column(label)
            for metric in PAIRED:
                table.add_column(metric.replace("_", " "), justify="right")
            for name, row in paired.items():
                table.add_row(name, *(_interval_text(row[m], signed=True) for m in PAIRED))
    console.print(table)
    if from_json is None:
        write_json(json_path, result.to_json())
    if plot:
        plot_compare(result, plot)
        console.print(f"wrote {plot}")
    command = "trace-rl " + shlex.join(sys.argv[1:])
    if paper_table is not None:
        text = table_markdown(paper_table, result, budget, command)
        console.print(text, markup=False, highlight=False)
    else:
        text = summary_markdown(result, command)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(markdown, text)
        console.print(f"wrote {markdown}")


def _staleness_values(text: str) -> tuple[int, ...]:
    """``--staleness 0,1,2`` → (0, 1, 2); the range and the 0 are CompareConfig's to check."""
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise fail(f"--staleness {text}: write whole numbers k >= 0, e.g. 0,1,2") from None


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
    """Fit the predictor on stored trees and save it (predictor.safetensors + predictor.json)."""
    import torch

    from trace_core.bench.predictor import (
        load_policy_tokenizer,
        load_trees,
        predictor_config,
        tree_paths,
    )
    from trace_core.policy.predictor import SharedPredictor

    tokenizer = load_policy_tokenizer(checkpoint)
    paths = tree_paths(trees)
    if resume:
        predictor = SharedPredictor.load(resume, tokenizer=tokenizer)
    else:
        predictor = SharedPredictor(
            predictor_config(tokenizer, featurizer, hidden, epochs),
            generator=torch.Generator().manual_seed(seed),
            tokenizer=tokenizer,
        )
    with console.status(f"fitting on {len(paths)} files"):
        fit = predictor.fit(load_trees(paths), torch.Generator().manual_seed(seed + 1))
    predictor.save(output)
    console.print(
        f"{fit.rows:,} rows (+{fit.replayed_rows:,} replayed), weighted MSE "
        f"{fit.loss_before:.4f} → {fit.loss_after:.4f} in {fit.seconds:.1f} s; wrote {output}"
    )


@predictor_app.command("score")
def predictor_score(
    run: Annotated[Path, typer.Argument(help="A `trace-rl train` run folder.")],
    plot: Annotated[
        Path | None, typer.Option(help="Reliability diagrams and skill per iteration (PNG).")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the scores here.")] = None,
    bins: Annotated[int, typer.Option(help="Forecast bins of the reliability diagram.")] = 10,
) -> None:
    """How well each iteration's predictor forecast the next iteration's trees (held out from
    it): Brier skill against a constant, AUC and calibration, for roots and for prefixes."""
    from dataclasses import asdict

    from trace_core.train.calibration import KINDS, plot_calibration, score_run

    if bins < 2:
        raise fail(f"bins must be >= 2, got {bins}")
    scored = score_run(run, bins)
    table = Table(
        title=f"{run}: each iteration's trees, forecast by the predictor before it",
        caption="skill: 1 − Brier ÷ the best constant's (above 0: better than a constant); "
        "AUC: chance a successful leaf's node was forecast above a failed one's (0.5: no "
        "ranking); calibration: the largest gap between forecast and observed rate over bins "
        "holding at least 5% of the outcomes.",
    )
    for head in ("iteration", "nodes", "outcomes", "skill", "AUC", "calibration gap"):
        table.add_column(head, justify="right")
    for s in scored:
        big = [abs(m - r) for m, r, n in s.reliability if n >= 0.05 * max(1, s.outcomes)]
        gap = f"{max(big):.3f}" if big else "-"
        table.add_row(
            f"{s.iteration} {KINDS[s.kind]}", f"{s.nodes:,}", f"{s.outcomes:,}",
            _signed(s.skill), _plain(s.auc), gap,
        )  # fmt: skip
    console.print(table)
    write_json(json_path, [asdict(s) for s in scored])
    if plot:
        plot_calibration(scored, plot)
        console.print(f"wrote {plot}")


def _signed(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.3f}"


def _plain(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"
