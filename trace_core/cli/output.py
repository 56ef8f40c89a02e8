"""What every command prints through: the console, a progress bar, the one error exit, the one
``--json`` writer.

    with expected_errors():          # ValueError, OSError, LookupError -> "error: ...", exit 2
        result = run_something(config)
    write_json(json_path, result.to_json())
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Logs and CI are not terminals; keep the tables on one line there.
console = Console(width=None if sys.stdout.isatty() else 160)

EXPECTED = (ValueError, OSError, LookupError)
"""What a config, a store, a schema or a query refuses: each message names the field or file
(``StoreError`` is an OSError; ``SchemaError``/``QueryError`` ValueErrors; ``TreeNotFound``
a LookupError)."""


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` and return the exit (code 2) for the caller to raise."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(2)


@contextlib.contextmanager
def expected_errors(*more: type[Exception]) -> Iterator[None]:
    """Turn the expected failures (and ``more``) raised in the block into ``fail``."""
    try:
        yield
    except (*EXPECTED, *more) as err:
        raise fail(str(err)) from None


def progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def write_json(path: Path | None, data: object) -> None:
    """Write ``data`` as indented JSON to ``path`` (its folder made) and say so; None: nothing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {path}")
