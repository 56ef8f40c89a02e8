"""Prompt files: a task suite's prompts as Parquet, the output of data prep and the input of a
rollout step.

    write_prompts("build/prompts/calc-train.parquet", "calc", suite.tasks("train"))
    task_name, tasks = read_prompts("build/prompts/calc-train.parquet")   # or an s3:// URI

One row per task with the ``Task`` fields (``id``, ``prompt``, ``answer``, ``difficulty``,
``split``, ``reference``); the file's metadata names the task suite whose env scores them.
Rewards stay the env's business: a row carries what the env needs to look the task up (its
id, for bfcl) or to check it (the answer), never code. A user can filter or subsample a
prompt file with any Parquet tool and roll out exactly those prompts.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trace_core.envs.base import Task
from trace_core.envs.source import open_source

PROMPT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("difficulty", pa.string()),
        ("split", pa.string()),
        ("reference", pa.list_(pa.string())),
    ],
    metadata={"trace.prompts.version": "1"},
)
TASK_KEY = b"trace.prompts.task"


def write_prompts(path: str | os.PathLike[str], task: str, tasks: Sequence[Task]) -> None:
    """Write ``tasks`` of suite ``task`` atomically (a reader never sees half a file)."""
    if not tasks:
        raise ValueError("no prompts to write")
    columns = {
        name: [getattr(t, name) for t in tasks]
        for name in ("id", "prompt", "answer", "difficulty", "split")
    }
    columns["reference"] = [list(t.reference) for t in tasks]
    schema = PROMPT_SCHEMA.with_metadata({**PROMPT_SCHEMA.metadata, TASK_KEY: task.encode()})
    table = pa.table(columns, schema=schema)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, target)


def read_prompts(uri: str) -> tuple[str, list[Task]]:
    """The suite name and the tasks of a prompt file (local path, ``file://`` or ``s3://``)."""
    try:
        table = pq.read_table(io.BytesIO(open_source(uri)))
    except pa.ArrowException as err:
        raise ValueError(f"{uri}: not a Parquet prompt file ({err})") from None
    meta = table.schema.metadata or {}
    if TASK_KEY not in meta:
        raise ValueError(f"{uri}: no task name in the file's metadata; write it with write_prompts")
    missing = [f.name for f in PROMPT_SCHEMA if f.name not in table.column_names]
    if missing:
        raise ValueError(f"{uri}: missing column(s) {', '.join(missing)}")
    for field in PROMPT_SCHEMA:
        kind = table.schema.field(field.name).type
        if not _castable(kind, field.type):
            raise ValueError(
                f"{uri}: column {field.name!r} has type {kind}, expected {field.type}; "
                "write the file with `trace-rl prep`"
            )
    if not table.num_rows:
        raise ValueError(f"{uri}: the prompt file has no rows; a rollout needs at least one")
    table = table.select([f.name for f in PROMPT_SCHEMA]).cast(
        PROMPT_SCHEMA.with_metadata(table.schema.metadata)
    )
    rows = table.to_pylist()
    tasks = []
    for n, row in enumerate(rows):
        for name in ("id", "prompt", "split"):
            if not row[name]:
                raise ValueError(f"{uri}, row {n}: column {name!r} is empty")
        if row["split"] not in ("train", "eval"):
            raise ValueError(f"{uri}, row {n}: split must be train or eval, got {row['split']!r}")
        tasks.append(
            Task(
                id=row["id"],
                prompt=row["prompt"],
                answer=row["answer"] or "",
                difficulty=row["difficulty"] or "",
                split=row["split"],
                reference=tuple(row["reference"] or ()),
            )
        )
    seen: set[str] = set()
    for n, t in enumerate(tasks):
        if t.id in seen:
            raise ValueError(f"{uri}, row {n}: task id {t.id!r} appears more than once")
        seen.add(t.id)
    return meta[TASK_KEY].decode(), tasks


def _castable(kind: pa.DataType, expected: pa.DataType) -> bool:
    """Strings may be large or dictionary-encoded, as other Parquet writers store them."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_list(expected):
        return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _castable(
            kind.value_type, expected.value_type
        )
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
