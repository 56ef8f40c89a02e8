"""DeepScaleR: loading every format, bad rows named, the seeded split, math-verify answers."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trace_core.envs.base import replay
from trace_core.envs.deepscaler import (
    MAX_ANSWER_CHARS,
    DeepScaleRSuite,
    check_math,
    load_deepscaler,
)

ROWS = [
    {"problem": "What is $1/2$ as a fraction?", "answer": "\\frac{1}{2}", "solution": "It is."},
    {"problem": "What is 2+2?", "answer": "4", "solution": "2+2=4."},
    {"problem": "Solve for x: x+1=4.", "answer": "3"},
    {"problem": "Give an interval.", "answer": "[0,1)"},  # cannot be written as answer[...]
]


def write(path: Path, rows: list[dict[str, object]]) -> str:
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("name", ["deepscaler.json", "deepscaler.jsonl", "deepscaler.parquet"])
def test_load_deepscaler_reads_every_format(tmp_path: Path, name: str) -> None:
    tasks = load_deepscaler(write(tmp_path / name, ROWS), eval_fraction=0.5)
    assert [t.id for t in tasks] == [f"deepscaler-{i}" for i in range(4)]
    assert [t.answer for t in tasks] == ["\\frac{1}{2}", "4", "3", "[0,1)"]
    assert Counter(t.split for t in tasks) == {"train": 2, "eval": 2}
    assert tasks[0].reference == ("answer[\\frac{1}{2}]",)
    assert tasks[3].reference == ()


def test_deepscaler_suite_replays_and_checks_with_math_verify(tmp_path: Path) -> None:
    suite = DeepScaleRSuite(write(tmp_path / "d.jsonl", ROWS), eval_fraction=0.0)
    assert suite.tasks("eval") == [] and len(suite.tasks("train")) == 4
    env = suite.make_env()
    for task in suite.tasks("train")[:3]:
        _, last = replay(env, task, task.reference)
        assert last is not None and last.reward == 1.0
    half = suite.tasks("train")[0]
    assert replay(env, half, ["answer[0.5]"])[1] == replay(env, half, ["answer[1/2]"])[1]
    assert replay(env, half, ["answer[0.5]"])[1].reward == 1.0  # type: ignore[union-attr]
    assert replay(env, half, ["calc[1/2]"])[0][-1] == "error: 1/2 is not a whole number"


@pytest.mark.parametrize(
    ("given_", "gold", "correct"),
    [
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "\\frac{1}{2}", True),
        ("3", "3", True),
        ("10.0", "10", True),
        ("1+x^2", "x^2+1", True),
        ("sqrt(2)", "\\sqrt{2}", True),
        ("4", "3", False),
        ("", "3", False),
        ("}{", "3", False),
        ("\\frac{", "\\frac{1}{2}", False),
    ],
)
def test_check_math(given_: str, gold: str, correct: bool) -> None:
    assert check_math(given_, gold) is correct


@pytest.mark.slow  # math-verify in a child process, stopped after 2 s
def test_a_runaway_check_is_stopped_and_counts_as_wrong() -> None:
    from trace_core.envs.deepscaler import _checker

    hostile = "^".join(["x"] * 40) + "^2"  # ≈20 s of sympy here unbounded: 10× the bound
    assert check_math("2", "2", seconds=2.0) is True
    pid = _checker(2.0).pid
    assert check_math(hostile, "1", seconds=2.0) is False
    assert _checker(2.0).pid is None  # the process was stopped, not left computing
    assert check_math("0.5", "\\frac{1}{2}", seconds=2.0) is True and _checker(2.0).pid != pid


def test_an_answer_over_the_bound_is_wrong_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    # math-verify's time grows faster than the length: 60,000 characters took about 40 s
    monkeypatch.setitem(sys.modules, "math_verify", None)  # importing it would raise
    long = "1" * (MAX_ANSWER_CHARS + 1)
    assert check_math(long, long) is False


def test_a_gold_answer_over_the_bound_has_no_reference(tmp_path: Path) -> None:
    fits, over = "1" * MAX_ANSWER_CHARS, "1" * (MAX_ANSWER_CHARS + 1)
    rows = [{"problem": "p", "answer": fits}, {"problem": "q", "answer": over}]
    tasks = load_deepscaler(write(tmp_path / "d.json", rows))
    assert [t.reference for t in tasks] == [(f"answer[{fits}]",), ()]


def test_deepscaler_bad_rows_are_named(tmp_path: Path) -> None:
    cases: list[tuple[list[object], str]] = [
        ([ROWS[0], {"problem": "p"}], "row 1 has no 'answer' field"),
        ([{"answer": "1"}], "row 0 has no 'problem' field"),
        ([ROWS[0], ROWS[1], {"problem": "", "answer": "1"}], "row 2 field 'problem'"),
        ([{"problem": "p", "answer": [1]}], "row 0 field 'answer'"),
        ([{"problem": "p", "answer": "1", "solution": 3}], "row 0 field 'solution'"),
        ([["p", "1"]], "row 0 is a list, expected an object"),
        ([], "no rows"),
    ]
    for rows, message in cases:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(rows))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_deepscaler(str(path))


def test_deepscaler_integer_answers_become_text(tmp_path: Path) -> None:
    tasks = load_deepscaler(write(tmp_path / "d.json", [{"problem": "p", "answer": 7}]))
    assert tasks[0].answer == "7"


def test_deepscaler_split_is_seeded(tmp_path: Path) -> None:
    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(50)]
    uri = write(tmp_path / "d.json", rows)
    a, b = load_deepscaler(uri, split_seed=1), load_deepscaler(uri, split_seed=1)
    assert a == b and sum(t.split == "eval" for t in a) == 5
    assert a != load_deepscaler(uri, split_seed=2)
    with pytest.raises(ValueError, match="eval_fraction"):
        load_deepscaler(uri, eval_fraction=1.5)


def test_deepscaler_uri_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PermissionError, match="no S3 credentials"):  # s3:// reads need them
        DeepScaleRSuite("s3://bucket/deepscaler.json")
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match=r"unknown dataset format '\.csv'"):
        load_deepscaler(str(tmp_path / "d.csv"))
