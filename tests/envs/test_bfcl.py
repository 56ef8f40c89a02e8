"""BFCL multi-turn env: every ground truth replays to 1, the split, BFCL's checks, safety.

Runs on the real bfcl-eval data and backends (installed ``--no-deps`` by ``make setup``);
the whole file takes a few seconds, most of it the 799 reference replays.
"""

from __future__ import annotations

import re
from itertools import accumulate
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.envs import bfcl
from trace_core.envs.base import MAX_OBSERVATION_CHARS, Step, Task, replay
from trace_core.envs.bfcl import (
    CATEGORIES,
    MAX_ACTION_CHARS,
    BfclEnv,
    BfclSuite,
    eval_indexes,
    load_category,
    parse_calls,
    read_action,
)

SUITE = BfclSuite()
TASKS = {t.id: t for split in ("train", "eval") for t in SUITE.tasks(split)}
# clip_observation may add " ... [truncated N chars]" after the limit
SLACK = len(" ... [truncated 10000000 chars]")


def start(task_id: str, suite: BfclSuite = SUITE) -> tuple[BfclEnv, Task]:
    env, task = suite.make_env(), TASKS[task_id]
    env.reset(task)
    return env, task


# --- the ground truth -------------------------------------------------------------------------
@pytest.mark.slow
def test_every_reference_replays_to_reward_one() -> None:
    failures = []
    for task in TASKS.values():
        observations, last = replay(SUITE.make_env(), task, task.reference)
        if last is None or not last.done or last.reward != 1.0:
            failures.append((task.id, observations[-1]))
    assert len(TASKS) == 799
    assert failures == []


def test_replays_are_deterministic() -> None:
    for task in list(TASKS.values())[::7]:
        first = replay(SUITE.make_env(), task, task.reference)
        env = SUITE.make_env()
        replay(env, task, task.reference[:1])  # a used env resets to the same start
        assert replay(env, task, task.reference) == first


def test_only_the_miss_func_task_calling_a_withheld_function_is_dropped() -> None:
    defects = {e.id: e.defect for c in CATEGORIES for e in load_category(c) if e.defect}
    assert defects == {
        "multi_turn_miss_func_49": "ground truth calls tail in request 1, shown at 3",
    }
    assert "multi_turn_miss_func_49" not in TASKS


def test_answering_without_calls_scores_zero() -> None:
    # Every task has ground-truth calls in some request, so an agent that only answers fails
    # at the first such request (BFCL's empty-turn check), and the episode ends there.
    for task in TASKS.values():
        answers = ["answer[ok]"] * len(task.reference)
        observations, last = replay(SUITE.make_env(), task, answers)
        assert last is not None and last.done and last.reward == 0.0, task.id
        assert "no call in request" in observations[-1]


# --- the split --------------------------------------------------------------------------------
def test_split_is_80_20_by_scenario_disjoint_and_fixed() -> None:
    train, eval_ = SUITE.tasks("train"), SUITE.tasks("eval")
    counts = {
        c: (sum(t.difficulty == c for t in train), sum(t.difficulty == c for t in eval_))
        for c in CATEGORIES
    }
    assert counts == {
        "base": (160, 40),
        "long_context": (160, 40),
        "miss_func": (159, 40),
        "miss_param": (160, 40),
    }
    assert not {t.id for t in train} & {t.id for t in eval_}
    assert all(t.split == "train" for t in train) and all(t.split == "eval" for t in eval_)
    # sha256 ranks are the same in every run and on every machine
    assert sorted(eval_indexes()) == [
        2, 7, 14, 15, 17, 18, 20, 26, 29, 30, 33, 37, 44, 46, 48, 65, 72, 82, 84, 86,
        89, 90, 92, 96, 108, 110, 118, 119, 122, 133, 138, 143, 155, 156, 159, 166, 173, 183,
        196, 199,
    ]  # fmt: skip
    # a scenario never straddles the split: its four variants sit on the same side
    assert {int(t.id.rsplit("_", 1)[1]) for t in eval_} == eval_indexes()
    assert [t.id for t in BfclSuite().tasks("eval")] == [t.id for t in eval_]


def test_task_fields() -> None:
    task = TASKS["multi_turn_base_0"]
    assert task.answer == "" and task.difficulty == "base" and task.split == "train"
    assert task.prompt.endswith(
        "User: Move 'final_report.pdf' within document directory to 'temp' directory in "
        "document. Make sure to create the directory"
    )
    assert "\ncd(folder: str) - Change the current working directory" in task.prompt
    assert "\npost_tweet(content: str, tags: list[str] = [], mentions: list[str] = [])" in (
        task.prompt
    )
    assert task.reference[:2] == (
        "call[cd(folder='document'), mkdir(dir_name='temp'), "
        "mv(source='final_report.pdf', destination='temp')]",
        "answer[Done.]",
    )
    assert len(task.reference) == 8  # 4 requests, each calls then answer
    assert len({t.difficulty for t in BfclSuite(categories=("miss_param",)).tasks("train")}) == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"categories": ()}, {"categories": ("multi_turn",)}, {"max_turns": 0}],
)
def test_suite_rejects_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        BfclSuite(**kwargs)  # type: ignore[arg-type]


# --- BFCL's checks ----------------------------------------------------------------------------
def test_state_check_fails_a_wrong_directory_name() -> None:
    env, _ = start("multi_turn_base_0")
    env.step("call[cd(folder='document'), mkdir(dir_name='tmp'), mv(source='final_report.pdf', "
             "destination='tmp')]")  # fmt: skip
    step = env.step("answer[moved]")
    assert (step.done, step.reward) == (True, 0.0)
    assert step.observation == (
        "episode over: request 0: GorillaFileSystem.root differs from the ground truth"
    )


def test_response_check_fails_a_skipped_read_only_call() -> None:
    # Request 1 is cd + grep; grep changes no state, so only the response check catches it.
    env, task = start("multi_turn_base_0")
    env.step(task.reference[0])
    env.step(task.reference[1])
    env.step("call[cd(folder='temp')]")
    step = env.step("answer[found it]")
    assert (step.done, step.reward) == (True, 0.0)
    assert "1 ground-truth result(s) not produced" in step.observation


def test_turn_limit_ends_with_reward_zero() -> None:
    env, task = start("multi_turn_base_0", BfclSuite(max_turns=3))
    steps = [env.step(action) for action in task.reference[:3]]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[-1] == Step("episode over: turn limit (3) reached", True, 0.0)


def test_protocol_misuse_raises() -> None:
    env = SUITE.make_env()
    with pytest.raises(RuntimeError):
        env.step("answer[x]")
    with pytest.raises(ValueError, match="not a task"):
        env.reset(Task("gsm8k_1", "q", "a", "easy", "train"))
    env, task = start("multi_turn_base_0")
    replay(env, task, task.reference)
    with pytest.raises(RuntimeError):
        env.step("answer[again]")


# --- miss_func --------------------------------------------------------------------------------
def test_withheld_function_is_not_callable_until_added() -> None:
    env, task = start("multi_turn_miss_func_0")  # sort is withheld until request 3
    assert "\nsort(" not in task.prompt
    assert env.step("call[sort(file_name='final_report.pdf')]").observation == (
        "error: no function named 'sort' is available"
    )
    for action in task.reference[:5]:  # requests 0-2
        step = env.step(action)
    assert step.observation.startswith("New functions:\n## This tool belongs to the Gorilla")
    assert "\nsort(file_name: str) - Sort the contents of a file line by line." in step.observation
    assert step.observation.endswith(
        "User: I have updated some more functions you can choose from. What about now?"
    )
    for action in task.reference[5:]:
        step = env.step(action)
    assert (step.done, step.reward) == (True, 1.0)


# --- safety -----------------------------------------------------------------------------------
HOSTILE = [
    "call[__import__('os').system('echo hi')]",
    "call[cd(folder=open('/etc/passwd').read())]",
    "call[os.system('echo hi')]",
    "call[ls.__globals__['__builtins__']['eval']('1')]",
    "call[(lambda: __import__('os').system('echo hi'))()]",
    'call[cd(folder=f\'{__import__("os").system("echo hi")}\')]',
    "call[cd(folder='x' * 10)]",
    "call[cd(folder='" + "x" * (MAX_ACTION_CHARS + 1) + "')]",
    "call[mean(numbers=" + "[" * 40 + "]" * 40 + ")]",
    "call[mean(numbers=" + "[" * 5000 + "]" * 5000 + ")]",
    "call[ls(a=" + "9" * 5000 + ")]",
    "call[cd(**{'folder': 'document'})]",
    "call[cd(*['document'])]",
    "call[cd(folder={'document'})]",
    "call[cd(folder=b'document')]",
    "call[cd(folder=1j)]",
    "call[ls(), __import__('os').system('echo hi')]",
    "call[ls()] + [__import__('os').system('echo hi')]",
    "call[[ls() for _ in range(3)]]",
    "call[_load_scenario({})]",
    "call[__init__()]",
    "call[eval('1')]",
    "call[exec('import os')]",
    "call[ls]",
    "call[]",
    "call[ls()",
    "ls()",
    "I will list the files.",
    "search[document]",
    "",
]


@pytest.mark.parametrize("action", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_actions_are_refused_without_side_effects(
    action: str, capfd: pytest.CaptureFixture[str]
) -> None:
    env, task = start("multi_turn_base_0")
    step = env.step(action)
    assert step.observation.startswith("error: ") and not step.done
    assert len(step.observation) <= MAX_OBSERVATION_CHARS + SLACK
    assert "hi" not in capfd.readouterr().out
    # Nothing ran: the untouched ground truth still scores 1 after the refused turn.
    for reference_action in task.reference:
        step = env.step(reference_action)
    assert (step.done, step.reward) == (True, 1.0)


def test_hostile_code_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    env, _ = start("multi_turn_base_0")
    for action in [
        f"call[__import__('pathlib').Path('{marker}').touch()]",
        f"call[echo(content='x', file_name=__import__('pathlib').Path('{marker}').touch())]",
        f"call[open('{marker}', 'w')]",
    ]:
        assert env.step(action).observation.startswith("error: ")
    assert not marker.exists()


def test_unknown_function_is_an_error() -> None:
    env, _ = start("multi_turn_base_0")
    step = env.step("call[rm_rf(path='/')]")
    assert step.observation == "error: no function named 'rm_rf' is available"
    # a real method of a class the task does not involve is unknown too
    assert "no function named 'add'" in env.step("call[add(a=1, b=2)]").observation


@pytest.mark.parametrize(
    "action",
    [
        "call[power(base=10, exponent=1000000000)]",
        "call[logarithm(value=10, base=2, precision=1000000)]",
        "call[square_root(number=2, precision=1000000)]",
    ],
)
def test_compute_bombs_are_refused_before_they_start(action: str) -> None:
    env, _ = start("multi_turn_base_15")  # GorillaFileSystem + MathAPI
    step = env.step(action)
    assert step.observation.endswith(": error: arguments too large to compute here")


def test_backend_exceptions_become_error_lines() -> None:
    env, _ = start("multi_turn_base_15")
    observation = env.step("call[cd(), pwd()]").observation
    assert observation.startswith("cd: error: TypeError: ")
    assert observation.splitlines()[1].startswith("pwd: {")


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_text_never_raises(text: str) -> None:
    env, _ = start("multi_turn_base_15")
    for action in (text, f"call[{text}]", f"call[ls({text})]"):
        step = env.step(action)
        assert len(step.observation) <= MAX_OBSERVATION_CHARS + SLACK
        if step.done:
            break


# --- reading actions --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("call[ls()]", ("call", "ls()")),
        ("Thought: list first.\ncall[ls(a=True)]  \n", ("call", "ls(a=True)")),
        ("call[echo(content='a] b [')]", ("call", "echo(content='a] b [')")),
        ("call[echo(content='call[x]')]", ("call", "echo(content='call[x]')")),
        ("call[echo(content='answer[[x]')]", ("call", "echo(content='answer[[x]')")),
        ("I could call[ls()] but answer[done [really]]", ("answer", "done [really]")),
        ("answer[later] call[ls()]", ("call", "ls()")),
        ("recall[x]", None),
        ("call[ls()] done", None),
        ("call[bad(]", ("call", "bad(")),
    ],
)
def test_read_action(text: str, expected: tuple[str, str] | None) -> None:
    assert read_action(text) == expected


_HEAD = re.compile(r"(?<![A-Za-z0-9_])(call|answer)\[")


def reference_read_action(text: str) -> tuple[str, str] | None:
    """The definition: for each of the last 16 heads, the bracket depth after every character of
    its body (an answer's must never go below 0 and end at 0)."""
    stripped = text.rstrip()
    heads = list(_HEAD.finditer(stripped)) if stripped.endswith("]") else []
    for head in heads[-16:]:
        kind, body = head.group(1), stripped[head.end() : -1]
        depths = list(accumulate({"[": 1, "]": -1}.get(char, 0) for char in body))
        if kind == "answer" and min(depths, default=0) >= 0 and not (depths and depths[-1]):
            return kind, body
        try:
            if kind == "call" and parse_calls(body):
                return kind, body
        except ValueError:
            continue
    calls = [head for head in heads if head.group(1) == "call"]
    return ("call", stripped[calls[-1].end() : -1]) if calls else None


ACTION_CHUNKS = ["call[", "answer[", "recall[", "ls()", "f(a=1)", ", ", "'", "[", "]", " ", "x"]


@given(st.lists(st.sampled_from(ACTION_CHUNKS), max_size=25).map("".join))
@settings(max_examples=500, deadline=None)
def test_read_action_equals_the_reference(text: str) -> None:
    assert read_action(text) == reference_read_action(text)


K = 200_000  # heads or brackets: each text below is about a megabyte


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # no body parses, so the last call's body comes back, to explain
        ("call[" * K + "]" * K, ("call", "]" * (K - 1))),
        ("answer[" * K + "]" * K, None),  # only the first head balances, and it is not tried
        ("call[ls()] " * K + "answer[done]", ("answer", "done")),
        ("call[" + "[" * K + "]" * (K + 1), ("call", "[" * K + "]" * K)),
        (
            "call[echo(content='" + "x" * (5 * K) + "')]",
            ("call", "echo(content='" + "x" * (5 * K) + "')"),
        ),
        ("answer[" + "]" * (5 * K), None),
    ],
    ids=[
        "nested calls",
        "nested answers",
        "many heads",
        "deep brackets",
        "long string",
        "unbalanced",
    ],
)
def test_megabyte_texts_are_read_right(text: str, expected: tuple[str, str] | None) -> None:
    assert read_action(text) == expected


def test_at_most_16_heads_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []

    def counting_parse_calls(text: str) -> list[bfcl.Call]:
        parsed.append(len(text))
        return parse_calls(text)

    monkeypatch.setattr(bfcl, "parse_calls", counting_parse_calls)
    assert read_action("call[" * K + "]") == ("call", "")
    assert len(parsed) == 16 and max(parsed) <= 15 * len("call[")


def test_parse_calls_keeps_positional_and_keyword_literals() -> None:
    (call,) = parse_calls("f('a', -1, 2.5, None, True, [1, (2, 3)], {'k': [None]}, z=-3)")
    assert call.name == "f"
    assert call.args == ("a", -1, 2.5, None, True, [1, (2, 3)], {"k": [None]})
    assert call.kwargs == {"z": -3}


# --- observations -----------------------------------------------------------------------------
def test_observations_are_clipped_and_calls_share_the_bound() -> None:
    suite = BfclSuite(categories=("long_context",), observation_chars=300)
    env, _ = start("multi_turn_long_context_1", suite)
    env.step("call[cd(folder='workspace'), cd(folder='archive')]")  # long context filled it
    one = env.step("call[ls(a=True)]").observation
    assert 300 < len(one) <= 300 + SLACK and one.startswith("ls: {")
    two = env.step("call[ls(a=True), pwd()]").observation.splitlines()
    assert two[0].startswith("ls: {") and len(two[0]) <= 150 + SLACK
    assert two[1].startswith("pwd: {")


def test_default_bound_holds_over_every_long_context_reference() -> None:
    clipped = 0
    for task in TASKS.values():
        if task.difficulty != "long_context":
            continue
        observations, _ = replay(SUITE.make_env(), task, task.reference)
        assert all(len(o) <= MAX_OBSERVATION_CHARS + SLACK for o in observations[1:])
        assert not any("[truncated" in o for o in observations[1:] if o.startswith("User:"))
        clipped += any("[truncated" in o for o in observations[1:])
    assert clipped > 100  # long context is long: most tasks see a clipped result
