"""HotpotQA: loading rows into tasks and passages, bad rows named, per-question search."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trace_core.envs.base import Step, Task, replay
from trace_core.envs.hotpotqa import MAX_ACTION_CHARS, HotpotQASuite, load_hotpotqa
from trace_core.envs.remote import RemoteSearch
from trace_core.envs.retrieval import Passage, render

HOTPOT = [
    {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
        "answer": "yes",
        "type": "comparison",
        "level": "hard",
        "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
        "context": [
            ["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker.", " He died in 1978."]],
            ["Scott Derrickson", ["Scott Derrickson is an American director."]],
            ["Woodson, Arkansas", ["Woodson is a census-designated place."]],
        ],
    },
    {
        "id": "5a8c7595554299585d9e36b6",
        "question": "What government position was held by the woman who portrayed Corliss?",
        "answer": "Chief of Protocol",
        "context": [
            ["Kiss and Tell (1945 film)", ["Kiss and Tell stars Shirley Temple as Corliss."]],
            ["Shirley Temple", ["Shirley Temple served as Chief of Protocol of the US."]],
        ],
    },
]


def write_json(path: Path, rows: list[object]) -> str:
    path.write_text(json.dumps(rows))
    return str(path)


def test_load_hotpotqa(tmp_path: Path) -> None:
    data = load_hotpotqa(write_json(tmp_path / "dev.json", HOTPOT), eval_fraction=1.0)
    first, second = data.tasks
    assert first.id == "hotpotqa-5a8b57f25542995d1e6f1371"
    assert second.id == "hotpotqa-5a8c7595554299585d9e36b6"  # "id" works as well as "_id"
    assert (first.difficulty, second.difficulty) == ("type=comparison,level=hard", "hotpotqa")
    assert {first.split, second.split} == {"eval"}
    assert first.reference == ("search[Scott Derrickson]", "search[Ed Wood]", "answer[yes]")
    assert second.reference == ("answer[Chief of Protocol]",)
    assert data.passages[first.id][0] == (
        "Ed Wood: Edward Davis Wood Jr. was an American filmmaker. He died in 1978."
    )


def test_hotpotqa_answer_that_cannot_be_an_action_has_no_reference(tmp_path: Path) -> None:
    row = {**HOTPOT[1], "answer": "[1, 2)", "supporting_facts": [["Shirley Temple", 0]]}
    (task,) = load_hotpotqa(write_json(tmp_path / "d.json", [row])).tasks
    assert task.reference == ()
    assert task.answer == "[1, 2)"


def test_hotpotqa_turns_over_the_limit_are_left_out_of_the_reference(tmp_path: Path) -> None:
    title, answer = "T" * MAX_ACTION_CHARS, "A" * MAX_ACTION_CHARS  # each turn 8 over
    row = {**HOTPOT[1], "supporting_facts": [[title, 0], ["Shirley Temple", 0]]}
    (task,) = load_hotpotqa(write_json(tmp_path / "d.json", [row])).tasks
    assert task.reference == ("search[Shirley Temple]", "answer[Chief of Protocol]")
    (task,) = load_hotpotqa(write_json(tmp_path / "d.json", [{**row, "answer": answer}])).tasks
    assert task.reference == ()


def test_hotpotqa_suite_searches_each_tasks_own_passages(tmp_path: Path) -> None:
    suite = HotpotQASuite(write_json(tmp_path / "dev.json", HOTPOT), eval_fraction=1.0)
    assert suite.tasks("train") == [] and len(suite.tasks("eval")) == 2
    env = suite.make_env()
    first, second = suite.tasks("eval")
    observations, last = replay(env, first, first.reference)
    assert last is not None and last.reward == 1.0
    assert observations[1].startswith("Scott Derrickson: Scott Derrickson is an American")
    assert replay(env, second, ["answer[chief of protocol.]"])[1] == Step("done", True, 1.0)
    # the second task cannot see the first task's paragraphs
    observations, _ = replay(env, second, ["search[Derrickson director]"])
    assert observations[1] == "no results"
    stranger = Task("x", "q", "a", "hotpotqa", "eval")
    with pytest.raises(ValueError, match="is not in"):
        env.reset(stranger)


def test_hotpotqa_corpus_is_every_distinct_paragraph(tmp_path: Path) -> None:
    """The corpus a retrieval service holds for the suite: each paragraph once, the title as
    its id (a suffix when another paragraph has the title), rendered back to the very passage
    the in-process index shows."""
    context = [
        ["Kiss and Tell (1945 film)", ["Kiss and Tell stars Shirley Temple as Corliss."]],
        ["Ed Wood", ["Other."]],
    ]
    again = {"id": "c", "question": "Who?", "answer": "Ed", "context": context}
    suite = HotpotQASuite(write_json(tmp_path / "dev.json", [*HOTPOT, again]))
    corpus = suite.corpus()
    assert [p.id for p in corpus] == [
        "Ed Wood",
        "Scott Derrickson",
        "Woodson, Arkansas",
        "Kiss and Tell (1945 film)",
        "Shirley Temple",
        "Ed Wood (2)",
    ]
    assert corpus[0].text == "Edward Davis Wood Jr. was an American filmmaker. He died in 1978."
    assert corpus[-1] == Passage("Ed Wood (2)", "Ed Wood", "Other.")
    every = {p for passages in suite.data.passages.values() for p in passages}
    assert sorted(render(p.contents) for p in corpus) == sorted(every)


def test_hotpotqa_with_a_retriever_searches_the_service(tmp_path: Path) -> None:
    url = "http://trace-retriever:8000"
    suite = HotpotQASuite(write_json(tmp_path / "dev.json", HOTPOT), retriever_url=url)
    first, second = suite.data.tasks
    search = suite.index_for(first)
    assert isinstance(search, RemoteSearch) and search.url == url
    assert suite.index_for(second) is search
    with pytest.raises(ValueError, match="is not in"):
        suite.index_for(Task("x", "q", "a", "hotpotqa", "eval"))


def test_hotpotqa_bad_rows_are_named(tmp_path: Path) -> None:
    good = HOTPOT[0]
    cases: list[tuple[object, str]] = [
        ({k: v for k, v in good.items() if k != "_id"}, "row 1 field '_id' (or 'id')"),
        ({**good, "_id": "b", "question": ""}, "row 1 field 'question'"),
        ({**good, "_id": "b", "answer": None}, "row 1 field 'answer'"),
        ({**good, "_id": "b", "context": []}, "row 1 field 'context' must be a non-empty list"),
        ({**good, "_id": "b", "context": [["t", "not a list"]]}, "row 1 field 'context'[0]"),
        ({**good, "_id": "b", "context": [["t", ["s", 3]]]}, "row 1 field 'context'[0] has a"),
        ({**good, "_id": "b", "supporting_facts": [[1, 0]]}, "row 1 field 'supporting_facts'[0]"),
        (good, "row 1 repeats id"),
        ("a string", "row 1 is a str, expected an object"),
    ]
    for row, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_hotpotqa(write_json(tmp_path / "bad.json", [good, row]))


def test_hotpotqa_uri_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PermissionError, match="no S3 credentials"):  # s3:// reads need them
        HotpotQASuite("s3://bucket/hotpot_dev_distractor_v1.json")
    (tmp_path / "dev.txt").write_text("[]")
    with pytest.raises(ValueError, match=r"unknown dataset format '\.txt'"):
        load_hotpotqa(str(tmp_path / "dev.txt"))
