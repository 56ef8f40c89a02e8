"""``trace-rl inspect ...``: stored rollout trees on disk or S3 (the logic is in
``trace_core/store``).

    trace-rl inspect summary runs/calc-local/trees
    trace-rl inspect query runs/calc-local/trees "SELECT strategy, count(*) FROM nodes GROUP BY 1"

Whatever the trees hold is printed as text, never as Rich markup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from trace_core.cli.output import console, fail, progress, write_json

if TYPE_CHECKING:
    from trace_core.store.treeset import TreeSource

app = typer.Typer(
    help="Rollout trees in a Parquet file, a folder or tree set, or s3://bucket/prefix: "
    "trace-rl inspect COMMAND PATH_OR_URI [ARGS]. S3 credentials come from AWS_* variables."
)
_TREES_HELP = "A Parquet file, a folder or tree set, or s3://bucket/prefix."
TreesArg = Annotated[
    str, typer.Argument(help=_TREES_HELP, metavar="PATH_OR_URI", show_default=False)
]
RunOpt = Annotated[str | None, typer.Option(help="Only trees of this run id.")]
IterationOpt = Annotated[int | None, typer.Option(help="Only trees of this iteration.")]


def beside(uri: str) -> Path:
    """Where ``inspect html`` writes by default: next to a local file or folder of trees, under
    its name (``trees.parquet`` → ``trees.html``, ``trees/`` → ``trees.html``); here for a URI."""
    if "://" in uri and not uri.startswith("file://"):
        return Path("trees.html")
    local = Path(uri.removeprefix("file://").rstrip("/"))
    return local.with_suffix(".html") if local.is_file() else local.with_name(local.name + ".html")


def _open_trees(uri: str) -> TreeSource:
    from trace_core.store.treeset import open_trees

    return open_trees(uri)


@app.command("summary")
def inspect_summary(
    uri: TreesArg,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the summary here.")] = (
        None
    ),
) -> None:
    """Trees, nodes, strategies, iterations, effective ratios, reward mix, units and tokens."""
    from trace_core.store.inspect import summarize, summary_table

    source = _open_trees(uri)
    with progress() as bar:
        job = bar.add_task("reading trees", total=len(source.keys))
        summary = summarize(source, progress=lambda done, _n: bar.update(job, completed=done))
    console.print(summary_table(summary))
    write_json(json_path, summary.to_json())


@app.command("query")
def inspect_query(
    uri: TreesArg,
    sql: Annotated[str, typer.Argument(help="One SELECT over the view `nodes`, one row per node.")],
    max_rows: Annotated[int, typer.Option(help="Rows printed at most (0: none).")] = 50,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write every row here (.parquet or .csv)."),
    ] = None,
) -> None:
    """Read-only DuckDB SQL over the trees; only the columns the query uses are read."""
    from trace_core.store.query import check_output, run_query, write_result

    if max_rows < 0:
        raise fail(f"--max-rows must be >= 0 (0: none), got {max_rows}")
    source = _open_trees(uri)
    if output:
        check_output(source, output)
    with console.status("querying"):
        result = run_query(source, sql)
    shown = f" (first {max_rows})" if 0 < max_rows < result.num_rows else ""
    # Text, never markup: a cell or column name such as "[/x]" is printed as it is.
    table = Table(title=Text(f"{result.num_rows:,} rows{shown}"))
    for name in result.column_names:
        table.add_column(Text(name), overflow="fold")
    for row in result.slice(0, max_rows).to_pylist():
        table.add_row(*(Text(_cell(v)) for v in row.values()))
    console.print(table)
    if output:
        write_result(result, output)
        console.print(Text(f"wrote {output}"))


def _cell(value: object, width: int = 60) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


@app.command("show")
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
    (tree,) = find_trees(source, [tree_id], run=run, iteration=iteration)
    console.print(render_tree(tree, width=width))


@app.command("html")
def inspect_html(
    uri: TreesArg,
    tree_ids: Annotated[
        list[int] | None, typer.Argument(help="tree_ids to show (default: the first --sample).")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="HTML file to write (default: beside the trees, runs/x/trees → runs/x/trees.html;"
            " trees.html here for s3://).",
            show_default=False,
        ),
    ] = None,
    run: RunOpt = None,
    iteration: IterationOpt = None,
    sample: Annotated[int, typer.Option(help="Trees shown when no tree_id is given.")] = 5,
    title: Annotated[str | None, typer.Option(help="Page title (default: the source).")] = None,
) -> None:
    """A self-contained HTML tree view (no network): collapsible turns, rewards, V and V̂."""
    from trace_core.store.html import render_html
    from trace_core.store.inspect import find_trees, sample_trees

    output = output or beside(uri)
    if output.suffix not in (".html", ".htm") or output.is_dir():
        raise fail(f"--output {output}: name an .html file")
    if sample < 1:
        raise fail(f"--sample must be >= 1, got {sample}")
    source = _open_trees(uri)
    if tree_ids:
        trees = find_trees(source, tree_ids, run=run, iteration=iteration)
    else:
        trees = sample_trees(source, sample)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.tmp")
    partial.write_text(render_html(trees, title=title or f"Rollout trees: {source.uri}"))
    os.replace(partial, output)
    console.print(
        Text(f"wrote {output} ({len(trees)} trees, {sum(t.size for t in trees):,} nodes)")
    )
