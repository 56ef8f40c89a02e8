"""Every suite by name (``make_suite``) and the reference check (``check_references``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from trace_core.envs import bfcl, calc, deepscaler, hotpotqa, multihop
from trace_core.envs.base import Split, Step, Task, TaskSuite
from trace_core.envs.calc import CalcEnv, CalcSuite
from trace_core.envs.multihop import MultihopSuite
from trace_core.envs.suites import SUITES, CheckReport, check_references, make_suite

CALC_LABELS = [f"ops={o},digits={d}" for o in (1, 2, 3) for d in (1, 2, 3)]


# --- make_suite ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["calc", "multihop", "bfcl"])
def test_suites_without_data_are_made_by_name(name: str) -> None:
    suite = make_suite(name)
    assert suite.name == name
    train, held_out = suite.tasks("train"), suite.tasks("eval")
    assert train and held_out
    assert {t.split for t in train} == {"train"} and {t.split for t in held_out} == {"eval"}
    assert not {t.id for t in train} & {t.id for t in held_out}
    env = suite.make_env()
    assert env.reset(held_out[0]) == held_out[0].prompt


@pytest.mark.parametrize("name", ["deepscaler", "hotpotqa"])
def test_loader_suites_ask_for_their_data(name: str) -> None:
    for data in (None, ""):
        with pytest.raises(ValueError, match=rf"task '{name}' reads a dataset: .*\(--data\)"):
            make_suite(name, data)


def test_unknown_suite_lists_the_names() -> None:
    with pytest.raises(ValueError) as err:
        make_suite("nope")
    assert str(err.value) == (
        "unknown task 'nope'; choose one of calc, calc-mix, multihop, bfcl, deepscaler, hotpotqa"
    )
    assert SUITES == ("calc", "calc-mix", "multihop", "bfcl", "deepscaler", "hotpotqa")


def test_make_suite_passes_the_seed() -> None:
    same, other = make_suite("calc", seed=0), make_suite("calc", seed=1)
    assert [t.prompt for t in same.tasks("eval")] == [t.prompt for t in CalcSuite().tasks("eval")]
    assert [t.prompt for t in other.tasks("eval")] != [t.prompt for t in same.tasks("eval")]


# --- check_references ----------------------------------------------------------------------------


def test_calc_references_all_score_one() -> None:
    report = check_references(make_suite("calc"))
    # 2000 train + 200 eval tasks, all nine difficulties.
    assert (report.task, report.tasks, report.mean_reward) == ("calc", 2200, 1.0)
    assert report.by_difficulty == dict.fromkeys(CALC_LABELS, 1.0)
    assert report.without_reference == 0 and report.failed == []


@pytest.mark.slow
def test_multihop_references_all_score_one() -> None:
    report = check_references(make_suite("multihop"))
    assert (report.task, report.tasks, report.mean_reward) == ("multihop", 2200, 1.0)
    assert report.by_difficulty == {"hops=2": 1.0, "hops=3": 1.0, "hops=4": 1.0}
    assert report.failed == []


def test_deepscaler_file_is_checked(tmp_path: Path) -> None:
    rows = [
        {"problem": "What is 6 times 7?", "answer": "42"},
        {"problem": "Half of one?", "answer": "\\frac{1}{2}"},
        {"problem": "Square of x?", "answer": "x^2", "solution": "x times x"},
        {"problem": "An integer gold answer", "answer": 17},
        {"problem": "An interval", "answer": "[0, 1)"},  # unbalanced: not writable as answer[...]
    ]
    path = tmp_path / "deepscaler.json"
    path.write_text(json.dumps(rows))
    report = check_references(make_suite("deepscaler", str(path)))
    # 5 rows, one without a reference: 4 replayed, each right by math-verify.
    assert (report.task, report.tasks, report.without_reference) == ("deepscaler", 4, 1)
    assert report.mean_reward == 1.0 and report.by_difficulty == {"deepscaler": 1.0}
    assert report.failed == []


@dataclass
class WrongCalc:
    """A suite whose first ``wrong`` train tasks carry a wrong reference answer."""

    wrong: int
    size: int
    name: str = "wrong-calc"

    def tasks(self, split: Split) -> list[Task]:
        if split == "eval":  # one task without a reference: skipped, and counted apart
            return [Task("no-reference", "q", "1", "none", "eval")]
        tasks = CalcSuite(seed=0, train_size=self.size, eval_size=0).tasks("train")
        return [
            replace(t, reference=(f"answer[{int(t.answer) + 1}]",)) if i < self.wrong else t
            for i, t in enumerate(tasks)
        ]

    def make_env(self) -> CalcEnv:
        return CalcEnv()


def test_failing_references_are_named() -> None:
    report = check_references(WrongCalc(wrong=3, size=9))
    # 9 tasks with a reference, 3 wrong: mean 6/9; the task without one is counted apart.
    assert report.tasks == 9 and report.without_reference == 1
    assert report.mean_reward == pytest.approx(6 / 9)
    assert report.failed == ["calc-train-00000", "calc-train-00001", "calc-train-00002"]
    # The wrong ones are the first three difficulties (tasks cycle through the nine labels).
    assert report.by_difficulty == {label: float(i >= 3) for i, label in enumerate(CALC_LABELS)}


def test_failed_ids_are_capped_at_twenty() -> None:
    report = check_references(WrongCalc(wrong=25, size=27))
    assert report.tasks == 27 and report.mean_reward == pytest.approx(2 / 27)
    assert report.failed == [f"calc-train-{i:05d}" for i in range(20)]


def test_report_json_keys() -> None:
    report = CheckReport(
        task="calc",
        tasks=3,
        mean_reward=2 / 3,
        without_reference=1,
        by_difficulty={"a": 1.0, "b": 0.5},
        failed=["x"],
    )
    data = json.loads(json.dumps(report.to_json()))
    assert data == {
        "task": "calc",
        "tasks": 3,
        "mean_reward": 2 / 3,
        "without_reference": 1,
        "by_difficulty": {"a": 1.0, "b": 0.5},
        "failed": ["x"],
    }


# --- the turn length limit -----------------------------------------------------------------------

LIMITS = {
    "calc": calc.MAX_ACTION_CHARS,
    "calc-mix": calc.MAX_ACTION_CHARS,
    "multihop": multihop.MAX_ACTION_CHARS,
    "bfcl": bfcl.MAX_ACTION_CHARS,
    "deepscaler": deepscaler.MAX_ACTION_CHARS,
    "hotpotqa": hotpotqa.MAX_ACTION_CHARS,
}
TOOLS = {
    "calc": "calc",
    "calc-mix": "calc",
    "multihop": "search",
    "bfcl": "call",
    "deepscaler": "calc",
    "hotpotqa": "search",
}
HOTPOT_ROW = {
    "_id": "q1",
    "question": "Where was Ann Lee born?",
    "answer": "Kara",
    "supporting_facts": [["Ann Lee", 0]],
    "context": [["Ann Lee", ["Ann Lee was born in Kara."]], ["Kara", ["Kara is a city."]]],
}


def small_suite(name: str, tmp_path: Path) -> TaskSuite:
    """The suite called ``name``; the loader suites read a one-row file."""
    rows = {
        "deepscaler": [{"problem": "What is 6 times 7?", "answer": "42"}],
        "hotpotqa": [HOTPOT_ROW],
    }
    if name not in rows:
        return make_suite(name)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(rows[name]))
    return make_suite(name, str(path))


def hostile_turns(size: int, tool: str) -> list[str]:
    """Turns of at most ``size`` characters in the shapes that cost a careless reader most:
    nested heads, deep brackets, an unbalanced tail, a long thought before a call."""
    heads = size // (len(tool) + 2)
    return [
        f"{tool}[" * heads + "]" * heads,
        "[" * (size // 2) + "]" * (size // 2),
        f"{tool}[" + "]" * (size - len(tool) - 1),
        "word " * (size // 5 - 4) + f"{tool}[1]",
    ]


@pytest.mark.parametrize("name", SUITES)
def test_every_reference_turn_fits_its_suites_limit(name: str, tmp_path: Path) -> None:
    suite = small_suite(name, tmp_path)
    tasks = suite.tasks("train") + suite.tasks("eval")
    turns = [turn for task in tasks for turn in task.reference]
    if isinstance(suite, CalcSuite | MultihopSuite):  # demonstrations that slip at every step
        rng = np.random.default_rng(0)
        turns += [turn for task in tasks[::10] for turn in suite.demonstration(task, rng, 1.0)]
    assert turns and max(map(len, turns)) <= LIMITS[name]


@pytest.mark.parametrize("name", SUITES)
def test_over_long_turns_are_refused_and_the_episode_goes_on(name: str, tmp_path: Path) -> None:
    suite = small_suite(name, tmp_path)
    limit, tool = LIMITS[name], TOOLS[name]
    task = (suite.tasks("eval") or suite.tasks("train"))[0]
    env = suite.make_env()
    refused = Step(f"error: action longer than {limit} characters", False, 0.0)
    # a megabyte, and one character over: refused unread, then the reference still scores 1
    for turn in [*hostile_turns(1_000_000, tool), "x" * (limit + 1)]:
        env.reset(task)
        assert env.step(turn) == refused
        for reference_turn in task.reference:
            step = env.step(reference_turn)
        assert (step.done, step.reward) == (True, 1.0)
    # up to the limit, turns are read (the last shape is a tool call after a long thought)
    for turn in hostile_turns(limit, tool):
        assert len(turn) <= limit
        env.reset(task)
        step = env.step(turn)
        assert step.observation != refused.observation and not step.done
