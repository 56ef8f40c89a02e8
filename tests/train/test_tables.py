"""The paper's tables (``trace-rl compare --table``): the arms each runs, budget shapes as
``strategy@MxN`` run configs, and the Markdown beside the paper's figures, from records made
by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_core.train.compare import CompareConfig, parse_arm, summarize
from trace_core.train.record import IterationRecord
from trace_core.train.tables import markdown, summary_markdown, table_arms


def record(i: int, accuracy: float, ratio: float) -> IterationRecord:
    report = {"pass1": {"all": accuracy}, "mean_k": {"all": accuracy}}
    rollout = {
        "prompt_effective_ratio": ratio,
        "anchor_effective_ratio": ratio,
        "mixed_per_100_units": ratio,
    }
    return IterationRecord(i, "x", 0, 100 * i, rollout if i else {}, {}, report, {})


def test_a_budget_shape_sets_the_runs_m_and_n() -> None:
    config = CompareConfig(strategies=("trace@64x6", "grpo"))
    shaped = config.run_config("trace@64x6", 3, Path("w"))
    assert (shaped.strategy, shaped.budget, shaped.continuations) == ("trace", 64, 6)
    assert shaped.output == Path("build/compare/trace@64x6/seed-3")
    plain = config.run_config("grpo", 3, Path("w"))
    assert (plain.budget, plain.continuations) == (config.run.budget, config.run.continuations)
    assert parse_arm("treepo@8x0").continuations == 0
    # the run's own shape is the plain strategy's run: the tables share it with a comparison
    own = config.run_config(f"trace@{config.run.budget}x{config.run.continuations}", 3, Path("w"))
    assert own.output == Path("build/compare/trace/seed-3")
    assert own == config.run_config("trace", 3, Path("w"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("trace@64", "write a budget shape as STRATEGY@MxN"),
        ("trace@0x2", "write a budget shape as STRATEGY@MxN"),
        ("nope@64x2", "unknown strategy 'nope'"),
    ],
)
def test_bad_arms_are_refused_by_name(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompareConfig(strategies=(name,))


def test_each_table_runs_the_papers_rows() -> None:
    assert table_arms("ablation", 128) == ("grpo", "treepo", "trace-root", "trace-prefix", "trace")
    assert table_arms("shape", 128) == (
        "treepo@64x2", "trace@64x2", "treepo@64x6", "trace@64x6", "treepo@128x2", "trace@128x2",
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown table 'both'"):
        table_arms("both", 128)


def test_ablation_markdown_by_hand() -> None:
    """Two seeds; trace's effective ratio 0.6 and 0.8 against grpo's 0.2 and 0.3: paired
    differences 0.4 and 0.5, mean 0.45."""
    arms = table_arms("ablation", 128)
    runs = {}
    for seed, (low, high) in enumerate(((0.2, 0.6), (0.3, 0.8))):
        for arm in arms:
            ratio = high if arm == "trace" else low
            runs[arm, seed] = [record(0, 0.5, 0), record(1, 0.6, ratio)]
    result = summarize(CompareConfig(strategies=arms, seeds=2), runs)
    text = markdown("ablation", result, 128, "trace-rl compare --table ablation")
    trace_row = next(line for line in text.splitlines() if "`trace`" in line)
    assert trace_row.startswith("| active | active | `trace` | 0.600 [0.600, 0.600] |")
    assert "| 0.700 [" in trace_row and "| +0.450 [" in trace_row
    assert trace_row.endswith("| 50.6 | 52.3% |")
    assert text.startswith("`trace-rl compare --table ablation` (calc, seeds 0..1;")


def test_shape_markdown_pairs_trace_with_treepo_per_shape() -> None:
    arms = table_arms("shape", 8)
    runs = {
        (arm, seed): [
            record(0, 0.5, 0),
            record(1, 0.5, (0.5 if "trace" in arm else 0.3) + seed / 10),
        ]
        for arm in arms
        for seed in (0, 1)
    }
    result = summarize(CompareConfig(strategies=arms, seeds=2), runs)
    rows = [line for line in markdown("shape", result, 8, "c").splitlines() if line[2:3].isdigit()]
    assert [row.split(" | ")[:3] for row in rows] == [
        ["| 4", "2", "8"],
        ["| 4", "6", "16"],
        ["| 8", "2", "16"],
    ]
    assert all("| +0.200 |" in row or "| +0.200 [" in row for row in rows)
    assert rows[1].endswith("| 512×6 | 49.4 / 50.3 | 37.7% / 47.8% |")


def test_summary_markdown_holds_every_strategy_and_its_pairing() -> None:
    """Without --table, --markdown writes every strategy's figures and its paired difference
    from grpo: trace 0.6 and 0.8 against grpo's 0.2 and 0.3, +0.45 on average."""
    runs = {}
    for seed, (low, high) in enumerate(((0.2, 0.6), (0.3, 0.8))):
        for arm in ("grpo", "trace"):
            runs[arm, seed] = [record(0, 0.5, 0), record(1, 0.6, high if arm == "trace" else low)]
    result = summarize(CompareConfig(strategies=("grpo", "trace"), seeds=2), runs)
    lines = summary_markdown(result, "trace-rl compare").splitlines()
    assert lines[0].startswith("`trace-rl compare` (calc, seeds 0..1;")
    grpo = next(line for line in lines if line.startswith("| `grpo` |"))
    assert grpo.startswith("| `grpo` | 0.600 [0.600, 0.600] | 0.600 [0.600, 0.600] | 0.250 [")
    assert grpo.endswith("| 1.000 [1.000, 1.000] | — | — |")  # no skills in made-up records
    paired = lines[lines.index("Paired against grpo, seed by seed (strategy − grpo):") :]
    assert any(
        line.startswith("| `trace` | +0.000 [+0.000, +0.000] | +0.000 [+0.000, +0.000] | +0.450 [")
        for line in paired
    )
