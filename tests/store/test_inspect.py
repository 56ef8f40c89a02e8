"""``trace-rl inspect``: the summary against ``measure``, one tree found and drawn, and the real
CLI on a local folder and on s3:// (SeaweedFS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import Result
from rich.console import Console
from typer.testing import CliRunner

from trace_core.algo.metrics import measure
from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.bench.store import sim_trees
from trace_core.store.artifacts import LocalStore, S3Store
from trace_core.store.inspect import (
    TreeNotFound,
    find_trees,
    metric_trees,
    render_tree,
    sample_trees,
    summarize,
)
from trace_core.store.schema import to_table
from trace_core.store.treeset import open_trees, write_tree_set


def test_summary_of_a_hand_tree(tmp_path: Path, tree_factory: Callable[..., RolloutTree]) -> None:
    write_tree_set(LocalStore(tmp_path), "t", [tree_factory(0)])
    s = summarize(open_trees(str(tmp_path)))
    g = s.total
    # Leaves 3, 4, 6, 7 with rewards 1, 0, 1, 1: one prompt, mixed.
    assert (g.trees, g.nodes, g.leaves, g.successes) == (1, 8, 4, 3)
    assert (g.prompts_all_failure, g.prompts_mixed, g.prompts_all_success) == (0, 1, 0)
    # Anchors: root (2 rollouts, mixed), node 1 (3 vs 4: mixed), node 5 (6, 7: both 1).
    m = g.metrics
    assert (m.anchors, m.mixed_groups, m.root_rollouts, m.continuations) == (3, 2, 2, 2)
    assert m.units == 2 * 1 + 2 * 0.5 and m.tokens == 7 * 2
    assert (s.runs, s.iterations, list(s.strategies)) == (("run-a",), (0,), ["trace"])


def test_summary_matches_measure_per_strategy(tmp_path: Path) -> None:
    trees = sim_trees(80)
    write_tree_set(LocalStore(tmp_path), "t", trees, rows_per_file=1000)
    s = summarize(open_trees(str(tmp_path)), progress=lambda done, total: None)
    assert s.files > 1
    assert s.total.metrics == measure(trees)
    for name, group in s.strategies.items():
        assert group.metrics == measure([t for t in trees if t.info.strategy == name])
    # The placeholder columns do not change what measure sees.
    assert measure(metric_trees(to_table(trees))) == measure(trees)


def test_find_trees_and_ambiguity(tmp_path: Path, tree_factory: Callable[..., RolloutTree]) -> None:
    trees = [tree_factory(i, iteration=it) for it in (0, 1) for i in range(3)]
    write_tree_set(LocalStore(tmp_path), "t", trees)
    source = open_trees(str(tmp_path))
    (found,) = find_trees(source, [2], iteration=1)
    assert found.equals(trees[5])
    with pytest.raises(TreeNotFound, match=r"tree_id 2 is in 2 trees: .*iteration 0.*--iteration"):
        find_trees(source, [2])
    with pytest.raises(TreeNotFound, match=rf"{tmp_path}: no tree with tree_id 9, iteration 1"):
        find_trees(source, [9], iteration=1)
    assert [t.info.tree_id for t in sample_trees(source, 4)] == [0, 1, 2, 0]


def test_render_tree_shows_turns_rewards_values_and_continuations(
    tree_factory: Callable[..., RolloutTree],
) -> None:
    console = Console(record=True, width=200, color_system=None)
    console.print(render_tree(tree_factory(4)))
    text = console.export_text()
    assert "tree 4 · prompt p4 · run run-a · iteration 0 · trace" in text
    assert "2 rollouts + 2 continuations = 3 units, 14 tokens" in text
    assert "#0 prompt What is 2+3?  V=0.50  V̂=0.75  n=4" in text
    assert "#1 calc[2+3] → 5  V=0.40  V̂=0.50  n=2" in text
    assert "#4 ↳ continuation answer[6]  r=0  V=—  V̂=0.00" in text
    assert "#7 ↳ continuation answer[<5>]  r=1  V=—  V̂=1.00" in text
    assert text.index("#3 answer[5]") < text.index("#4 ↳") < text.index("#2 search[2+3]")


# --- the real CLI ------------------------------------------------------------------------------
def trace_rl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("trace-rl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trace_core.cli"]
    full_env = {**os.environ, **(env or {}), "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [*command, *args], env=full_env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # runs trace-rl
def test_cli_on_a_local_folder(tmp_path: Path, tree_factory: Callable[..., RolloutTree]) -> None:
    trees = [tree_factory(i, strategy=s) for i, s in enumerate(["trace", "grpo", "trace"])]
    write_tree_set(LocalStore(tmp_path / "run"), "iter-0/trees", trees)
    folder = str(tmp_path / "run")

    out = trace_rl("inspect", "summary", folder, "--json", str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr
    assert "3 trees, 24 nodes in 1 file(s)" in out.stdout and "grpo" in out.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["total"]["prompt_effective_ratio"] == 1.0
    assert summary["strategies"]["trace"]["trees"] == 2

    sql = "SELECT tree_id, count(*) AS n FROM nodes WHERE reward = 0 GROUP BY 1 ORDER BY 1"
    out = trace_rl("inspect", "query", folder, sql, "-o", str(tmp_path / "q.parquet"))
    assert out.returncode == 0, out.stderr
    assert "3 rows" in out.stdout
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "q.parquet").to_pylist() == [
        {"tree_id": i, "n": 1} for i in range(3)
    ]

    out = trace_rl("inspect", "show", folder, "1")
    assert out.returncode == 0, out.stderr
    assert "tree 1 · prompt p1 · run run-a · iteration 0 · grpo" in out.stdout
    assert "↳ continuation answer[6]  r=0" in out.stdout

    out = trace_rl("inspect", "html", folder, "0", "2", "-o", str(tmp_path / "t.html"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t.html").read_text().count('class="tree"') == 2

    for args, message in [
        (("show", folder, "7"), "no tree with tree_id 7"),
        (("summary", str(tmp_path / "nope")), "nope: no such file, folder or prefix"),
    ]:
        out = trace_rl("inspect", *args)
        assert out.returncode == 2 and message in out.stdout, out.stdout + out.stderr
        assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.cluster  # a SeaweedFS server
def test_cli_on_s3(
    s3_env: dict[str, str], bucket_store: S3Store, tree_factory: Callable[..., RolloutTree]
) -> None:
    write_tree_set(bucket_store, "iter-3/trees", [tree_factory(i) for i in range(2)])
    uri = f"s3://trace/{bucket_store.prefix}"
    out = trace_rl("inspect", "summary", uri, env=s3_env)
    assert out.returncode == 0, out.stderr
    assert f"{uri}: 2 trees, 16 nodes in 1 file(s)" in out.stdout
    out = trace_rl(
        "inspect", "query", uri, "SELECT count(*) AS leaves FROM nodes WHERE is_leaf", env=s3_env
    )
    assert out.returncode == 0 and "│ 8 " in out.stdout, out.stdout + out.stderr
    # Wrong credentials: a clear error naming the URI, never the secret.
    secret = "definitely-not-the-secret"
    out = trace_rl("inspect", "summary", uri, env={**s3_env, "AWS_SECRET_ACCESS_KEY": secret})
    assert out.returncode == 2 and f"{uri}: access denied" in out.stdout, out.stdout + out.stderr
    assert secret not in out.stdout + out.stderr


# --- the CLI in process ------------------------------------------------------------------------
MARKUP = ("[/x]", "[bold]", "search[bo lin born]")


def markup_tree() -> RolloutTree:
    """A tree whose run, strategy and turns read as Rich markup if printed as markup."""
    info = TreeInfo("run-[b]", 0, "p[/x]", 0, "trace[bold]", 1)
    b = TreeBuilder(info, prompt_tokens=np.arange(3, dtype=np.int32), prompt_text="[/x] prompt")
    n1 = b.add_turn(0, [5], [6], [-0.5], text="search[bo lin born]", observation="[bold]found")
    n2 = b.add_turn(n1, [7], [], [-0.5], text="answer[/x]")
    b.set_reward(n2, 1)
    return b.build()


@pytest.fixture
def cli() -> Callable[..., Result]:
    from trace_core.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["inspect", *args], catch_exceptions=False)


def test_cli_prints_text_never_markup(tmp_path: Path, cli: Callable[..., Result]) -> None:
    write_tree_set(LocalStore(tmp_path), "t", [markup_tree()])
    folder = str(tmp_path)

    out = cli(
        "query", folder, 'SELECT text AS "[bold]head", observation FROM nodes ORDER BY node_id'
    )
    assert out.exit_code == 0, out.output
    for literal in (
        "[bold]head",
        "[/x] prompt",
        "search[bo lin born]",
        "[bold]found",
        "answer[/x]",
    ):
        assert literal in out.output

    out = cli("show", folder, "0")
    assert out.exit_code == 0, out.output
    assert "prompt p[/x] · run run-[b] · iteration 0 · trace[bold]" in out.output
    assert "#1 search[bo lin born] → [bold]found" in out.output and "#2 answer[/x]" in out.output

    out = cli("summary", folder)
    assert out.exit_code == 0, out.output
    assert "runs run-[b];" in out.output and "trace[bold]" in out.output


def test_cli_query_refuses_what_is_not_one_query(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    write_tree_set(LocalStore(tmp_path), "t", [markup_tree()])
    (part,) = (tmp_path / "t").glob("*.parquet")
    before = part.read_bytes()
    for sql, message in [
        (f"COPY nodes TO '{part}'", "error: only one SELECT query is allowed, got COPY"),
        ("SELECT * FROM read_csv('/etc/passwd')", "refused: it reaches past the view nodes"),
    ]:
        out = cli("query", str(tmp_path), sql)
        assert out.exit_code == 2 and message in " ".join(out.output.split()), out.output
    assert part.read_bytes() == before


def test_cli_query_output(tmp_path: Path, cli: Callable[..., Result]) -> None:
    write_tree_set(LocalStore(tmp_path / "run"), "t", [markup_tree()])
    folder = str(tmp_path / "run")
    (part,) = (tmp_path / "run" / "t").glob("*.parquet")
    before = part.read_bytes()

    # Written whole: the rows, and nothing else beside them.
    result = tmp_path / "out" / "leaves.csv"
    out = cli("query", folder, "SELECT node_id, text FROM nodes WHERE is_leaf", "-o", str(result))
    assert out.exit_code == 0, out.output
    assert result.read_text().splitlines() == ['"node_id","text"', '2,"answer[/x]"']
    assert os.listdir(result.parent) == ["leaves.csv"]

    # A failed write leaves the file that was there, and no partial file.
    out = cli("query", folder, "SELECT gen_token_ids FROM nodes", "-o", str(result))
    assert out.exit_code == 2 and "CSV has no list columns" in out.output, out.output
    assert result.read_text().splitlines()[1] == '2,"answer[/x]"'
    assert os.listdir(result.parent) == ["leaves.csv"]

    # The trees themselves are never the output.
    out = cli("query", folder, "SELECT 1 AS one", "-o", str(part))
    said = " ".join(out.output.split())
    assert out.exit_code == 2 and f"--output {part} is a trees file of {folder}" in said, said
    assert part.read_bytes() == before
    out = cli("query", folder, "SELECT 1", "-o", str(tmp_path / "rows.json"))
    assert out.exit_code == 2 and "name a .parquet or .csv file" in out.output, out.output

    out = cli("query", folder, "SELECT * FROM nodes", "--max-rows", "-1")
    assert out.exit_code == 2 and "--max-rows" in out.output, out.output
    out = cli("query", folder, "SELECT * FROM nodes", "--max-rows", "0")
    assert out.exit_code == 0 and "3 rows" in out.output and "[/x]" not in out.output
