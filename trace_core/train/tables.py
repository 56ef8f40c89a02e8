"""The paper's two tables, measured here and printed beside the paper's own figures.

    trace-rl compare --task calc-mix --table ablation --seeds 5 --markdown docs/ablation.md
    trace-rl compare --task calc-mix --table shape --seeds 5 --markdown docs/shape.md

- ``ablation``: which stage adds what. Uniform or active root allocation (stage 1) × uniform
  (random) or active (predicted flip) prefix expansion (stage 2) = ``treepo``, ``trace-root``,
  ``trace-prefix``, ``trace``; ``grpo`` (fixed groups, no trees) as the anchor of the paired
  intervals.
- ``shape``: the budget's shape M×N. ``treepo`` and ``trace`` at (M/2, 2), (M/2, 6) and (M, 2):
  the last two spend the same M(1 + N/2) units, the first half of it — the paper's (512, 2),
  (512, 6) and (1024, 2).

The paper's figures are Qwen3-8B on multi-hop QA (accuracy, %, and prompt effective ratio, %);
ours are the tiny policy on ``--task``, so the comparison is of directions and orderings, not
of values. Each measured cell is the mean over seeds with its 95% Student-t interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from trace_core.train.compare import CompareResult, bounds, interval

TABLES = ("ablation", "shape")


@dataclass(frozen=True)
class PaperRow:
    """One row of a paper table: the arm we run for it and the paper's figures (%)."""

    arm: str
    label: tuple[str, ...]
    accuracy: float | None
    effective: float | None


def ablation_rows() -> tuple[PaperRow, ...]:
    return (
        PaperRow("grpo", ("groups of G", "none"), 48.5, None),
        PaperRow("treepo", ("uniform", "uniform"), 49.5, 42.8),
        PaperRow("trace-root", ("active", "uniform"), 49.8, 49.1),
        PaperRow("trace-prefix", ("uniform", "active"), 50.0, 47.3),
        PaperRow("trace", ("active", "active"), 50.6, 52.3),
    )


SHAPE_PAPER = {  # (M, N) of the paper → (treepo acc, trace acc, treepo eff, trace eff), %
    (512, 2): (48.8, 49.7, 32.2, 42.4),
    (512, 6): (49.4, 50.3, 37.7, 47.8),
    (1024, 2): (49.5, 50.6, 42.8, 52.3),
}


def shapes(budget: int) -> tuple[tuple[int, int, tuple[int, int]], ...]:
    """(M, N, the paper's M and N) of each shape row, for the run's budget M."""
    if budget < 2:
        raise ValueError(f"budget: the shape table halves it, so it must be >= 2, got {budget}")
    half = budget // 2
    return ((half, 2, (512, 2)), (half, 6, (512, 6)), (budget, 2, (1024, 2)))


def table_arms(table: str, budget: int) -> tuple[str, ...]:
    """The compare arms (``strategy`` or ``strategy@MxN``) one table runs."""
    if table == "ablation":
        return tuple(row.arm for row in ablation_rows())
    if table == "shape":
        return tuple(f"{s}@{m}x{n}" for m, n, _ in shapes(budget) for s in ("treepo", "trace"))
    raise ValueError(f"table: unknown table {table!r}; choose one of {', '.join(TABLES)}")


def markdown(table: str, result: CompareResult, budget: int, command: str) -> str:
    """The table as Markdown: what was measured (mean [95% interval]) beside the paper."""
    if table == "ablation":
        body = _ablation(result)
    elif table == "shape":
        body = _shape(result, budget)
    else:
        raise ValueError(f"table: unknown table {table!r}; choose one of {', '.join(TABLES)}")
    first, count = result.seeds
    return (
        f"`{command}` ({result.config['task']}, seeds {first}..{first + count - 1}; "
        "mean [95% Student-t interval over seeds]; mean@k: held-out accuracy sampled at "
        "temperature 1; eff.: prompt effective ratio, the share of prompts whose rollouts hold "
        "both rewards, mean over iterations; paper: Qwen3-8B, multi-hop QA, %)\n\n" + body
    )


SUMMARY = (
    ("accuracy", "mean@k"),
    ("pass1", "pass@1"),
    ("prompt_effective_ratio", "prompt eff."),
    ("anchor_effective_ratio", "anchor eff."),
    ("mixed_per_100_units", "mixed / 100 units"),
    ("tokens_to_grpo_final", "tokens to grpo final"),
    ("root_skill", "root skill"),
    ("eval_root_skill", "root skill (held out)"),
)
"""The summary's columns: metric, header."""


def summary_markdown(result: CompareResult, command: str) -> str:
    """Every strategy's figures (mean [95% interval]) and each one's paired difference from
    grpo, as Markdown: what ``trace-rl compare --markdown`` writes without ``--table``."""
    first, count = result.seeds
    lines = [
        f"`{command}` ({result.config['task']}, seeds {first}..{first + count - 1}; "
        "mean [95% Student-t interval over seeds])",
        "",
        "| strategy | " + " | ".join(header for _, header in SUMMARY) + " |",
        "|---|" + "---|" * len(SUMMARY),
    ]
    for name, row in result.strategies.items():
        cells = " | ".join(_summary_cell(metric, row.get(metric), count) for metric, _ in SUMMARY)
        lines.append(f"| `{name}` | {cells} |")
    if result.paired:
        title = "Paired against grpo, seed by seed (strategy − grpo):"
        lines += _paired_markdown(result.paired, title, "strategy")
    if result.paired_staleness:
        title = "Paired against k = 0, seed by seed (arm − the same strategy at k = 0):"
        lines += _paired_markdown(result.paired_staleness, title, "arm")
    return "\n".join(lines) + "\n"


def _paired_markdown(
    paired: Mapping[str, Mapping[str, dict[str, float]]], title: str, label: str
) -> list[str]:
    """A block of paired differences (``label`` → metric → its stats), under ``title``."""
    columns = [(m, h) for m, h in SUMMARY if m in next(iter(paired.values()))]
    lines = [
        "",
        title,
        "",
        f"| {label} | " + " | ".join(header for _, header in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, row in paired.items():
        cells = " | ".join(_cell(row[metric], signed=True) for metric, _ in columns)
        lines.append(f"| `{name}` | {cells} |")
    return lines


def _summary_cell(metric: str, stats: dict[str, float] | None, seeds: int) -> str:
    """A summary cell; tokens to grpo's final accuracy, where a seed never got there, says how
    many did (the mean over the seeds is then infinite)."""
    if metric == "tokens_to_grpo_final" and stats and not np.isfinite(stats["mean"]):
        return f"not reached ({int(stats['n'])} of {seeds} seeds did)"
    return _cell(stats)


def _ablation(result: CompareResult) -> str:
    lines = [
        "| stage 1 (roots) | stage 2 (prefixes) | strategy | mean@k | eff. | eff. − grpo (paired) "
        "| paper acc. | paper eff. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in ablation_rows():
        stats = result.strategies[row.arm]
        paired = result.paired.get(row.arm, {}).get("prompt_effective_ratio")
        lines.append(
            f"| {row.label[0]} | {row.label[1]} | `{row.arm}` | {_cell(stats['accuracy'])} "
            f"| {_cell(stats['prompt_effective_ratio'])} | {_cell(paired, signed=True)} "
            f"| {_paper(row.accuracy)} | {_paper(row.effective, '%')} |"
        )
    return "\n".join(lines) + "\n"


def _shape(result: CompareResult, budget: int) -> str:
    lines = [
        "| M | N | units M(1+N/2) | treepo mean@k | trace mean@k | treepo eff. | trace eff. "
        "| trace − treepo eff. (paired) | paper M×N | paper acc. treepo / trace "
        "| paper eff. treepo / trace |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, n, paper in shapes(budget):
        tree, trace = result.strategies[f"treepo@{m}x{n}"], result.strategies[f"trace@{m}x{n}"]
        seeds = result.per_seed
        diff = interval(
            list(
                np.subtract(
                    seeds[f"trace@{m}x{n}"]["prompt_effective_ratio"],
                    seeds[f"treepo@{m}x{n}"]["prompt_effective_ratio"],
                )
            )
        )
        acc_t, acc_r, eff_t, eff_r = SHAPE_PAPER[paper]
        lines.append(
            f"| {m} | {n} | {m * (2 + n) // 2} | {_cell(tree['accuracy'])} "
            f"| {_cell(trace['accuracy'])} | {_cell(tree['prompt_effective_ratio'])} "
            f"| {_cell(trace['prompt_effective_ratio'])} | {_cell(diff, signed=True)} "
            f"| {paper[0]}×{paper[1]} | {acc_t} / {acc_r} | {eff_t}% / {eff_r}% |"
        )
    return "\n".join(lines) + "\n"


def _cell(stats: dict[str, float] | None, signed: bool = False) -> str:
    if stats is None or not np.isfinite(stats["mean"]):
        return "—"
    sign = "+" if signed else ""
    mean, (low, high) = stats["mean"], bounds(stats)
    if not np.isfinite(low):
        return f"{mean:{sign}.3f}"
    return f"{mean:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


def _paper(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value}{unit}"
