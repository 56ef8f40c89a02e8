"""Prompt files: round trip, the errors a hand-edited file gets, and a rollout from one."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trace_core.envs.calc import CalcSuite
from trace_core.envs.prompts import PROMPT_SCHEMA, TASK_KEY, read_prompts, write_prompts


@pytest.fixture(scope="module")
def tasks():  # type: ignore[no-untyped-def]
    return CalcSuite(seed=0, train_size=20, eval_size=5).tasks("train")


def test_round_trip_keeps_every_field(tasks, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    write_prompts(tmp_path / "p.parquet", "calc", tasks)
    name, back = read_prompts(str(tmp_path / "p.parquet"))
    assert name == "calc" and back == tasks
    assert not list(tmp_path.glob("*.tmp"))


def test_a_filtered_file_still_reads(tasks, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Users subsample prompt files with Parquet tools: the metadata survives a filter."""
    write_prompts(tmp_path / "p.parquet", "calc", tasks)
    table = pq.read_table(tmp_path / "p.parquet")
    pq.write_table(table.slice(0, 3), tmp_path / "few.parquet")
    name, back = read_prompts(str(tmp_path / "few.parquet"))
    assert name == "calc" and back == tasks[:3]


def _write(path: Path, rows: dict[str, list[object]], task: bytes | None = b"calc") -> str:
    schema = PROMPT_SCHEMA
    if task is not None:
        schema = schema.with_metadata({**schema.metadata, TASK_KEY: task})
    fields = [f for f in schema if f.name in rows]
    pq.write_table(pa.table(rows, schema=pa.schema(fields, metadata=schema.metadata)), path)
    return str(path)


ROW = {
    "id": ["a"],
    "prompt": ["what is 1 + 1 ?"],
    "answer": ["2"],
    "difficulty": ["easy"],
    "split": ["train"],
    "reference": [["answer[2]"]],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": [""]}, "row 0: column 'prompt' is empty"),
        ({"split": ["test"]}, "row 0: split must be train or eval"),
        ({"id": ["a", "a"], **{k: v * 2 for k, v in ROW.items() if k != "id"}}, "'a' appears more"),
    ],
)
def test_bad_rows_are_named(tmp_path: Path, change: dict[str, list[object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_prompts(_write(tmp_path / "p.parquet", {**ROW, **change}))


def test_missing_column_and_metadata_are_named(tmp_path: Path) -> None:
    rows = {k: v for k, v in ROW.items() if k != "answer"}
    with pytest.raises(ValueError, match=r"missing column.*answer"):
        read_prompts(_write(tmp_path / "a.parquet", rows))
    with pytest.raises(ValueError, match="no task name"):
        read_prompts(_write(tmp_path / "b.parquet", ROW, task=None))
    (tmp_path / "c.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"c\.parquet: not a Parquet prompt file"):
        read_prompts(str(tmp_path / "c.parquet"))
