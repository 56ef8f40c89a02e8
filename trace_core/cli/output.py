"""What every command prints through: the console, a progress bar, the one error exit, the one
``--json`` writer.

Every command runs inside ``CommandGroup``: an expected failure raised anywhere below it (bad
input, a damaged file, a refused S3 request) ends the command with one line and exit code 2,

    error: <what>, <which file, field or row>, <what to do>

and a traceback only with ``trace-rl --debug`` (or ``TRACE_DEBUG=1``). Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup

# Logs and CI are not terminals; keep the tables on one line there.
console = Console(width=None if sys.stdout.isatty() else 160)

EXPECTED = (ValueError, OSError, LookupError)
"""What a config, a store, a schema or a query refuses: each message names the field or file
(``StoreError`` is an OSError; ``SchemaError``/``QueryError`` ValueErrors; ``TreeNotFound``
a LookupError; JSON and Arrow's invalid-data errors are ValueErrors, Arrow's IO errors
OSErrors)."""

EXPECTED_ELSEWHERE = frozenset(
    {
        "safetensors_rust.SafetensorError",  # a damaged weights file
        "pyarrow.lib.ArrowException",  # any Arrow failure reading a Parquet file
        "minio.error.MinioException",  # an S3 reply the store did not translate
        "huggingface_hub.errors.HFValidationError",  # a path HF took for a repo id
        "trace_core.rollout.engine_start.EngineStartError",  # engines that did not start: the cause
        "trace_core.rollout.waits.WaitTimeoutError",  # actors stuck in a call: which, which call
        "trace_core.train.weights.TrainersLostError",  # the checkpoint a rerun resumes from
        "trace_core.train.weights.EnginesLostError",  # the checkpoint a rerun resumes from
        "trace_core.rollout.ray_auth.RayAuthError",  # the Ray head's token: which Secret, variable
    }
)
"""Library errors that are the input's fault, named so that the CLI imports none of them."""

DEBUG_ENV = "TRACE_DEBUG"


def is_expected(err: BaseException) -> bool:
    if isinstance(err, EXPECTED):
        return True
    return any(f"{c.__module__}.{c.__qualname__}" in EXPECTED_ELSEWHERE for c in type(err).__mro__)


def debugging(ctx: click.Context | None = None) -> bool:
    """``trace-rl --debug`` or ``TRACE_DEBUG=1``: show tracebacks instead of error lines."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return True
    ctx = ctx or click.get_current_context(silent=True)
    return bool(ctx and ctx.find_root().params.get("debug"))


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` and return the exit (code 2) for the caller to raise."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def describe(err: BaseException) -> str:
    """The one line an expected failure prints: its message, else its kind."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, KeyError) and str(err).startswith("'"):
        text = f"missing key {text}"
    return text


class CommandGroup(TyperGroup):
    """The root command: runs the chosen command and turns expected failures into ``fail``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as err:
            if debugging(ctx) or not is_expected(err):
                raise
            raise fail(describe(err)) from None


@contextlib.contextmanager
def expected_errors(*more: type[Exception]) -> Iterator[None]:
    """Treat ``more`` (say, a submit error or a failed step's RuntimeError) as expected failures
    in the block; the kinds every command expects need no block (``CommandGroup``)."""
    try:
        yield
    except more as err:
        if debugging():
            raise
        raise fail(describe(err)) from None


def progress() -> Progress:
    """A live bar on a terminal; nothing in a log, where a live bar cannot redraw."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def write_json(path: Path | None, data: object) -> None:
    """Write ``data`` as indented JSON to ``path`` (its folder made, atomically) and say so;
    None: nothing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    console.print(f"wrote {path}")


def read_json(path: Path, flag: str) -> Any:
    """The JSON object in ``path``; a missing or unreadable file fails naming ``flag`` and it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise fail(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(f"{flag} {path}: not JSON ({describe(err)})") from None
    if not isinstance(data, dict):
        raise fail(f"{flag} {path}: not a JSON object")
    return data
