"""The calc suite: its problems, its env's turn protocol, its demonstrations."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.envs.base import TURN_LIMIT, Task, replay
from trace_core.envs.calc import (
    DIFFICULTIES,
    CalcEnv,
    CalcSuite,
    Chain,
    Operation,
    chain_of,
    check_integer,
    draw_chain,
)


@pytest.fixture(scope="module")
def suite() -> CalcSuite:
    return CalcSuite(seed=0)


def make_task(prompt: str = "q", answer: str = "57") -> Task:
    return Task(id="t", prompt=prompt, answer=answer, difficulty="ops=1,digits=1", split="train")


# --- the problems --------------------------------------------------------------------------------


def test_references_replay_to_reward_one(suite: CalcSuite) -> None:
    env = suite.make_env()
    for task in suite.tasks("train")[:200] + suite.tasks("eval"):
        observations, last = replay(env, task, task.reference)
        assert last is not None and last.done and last.reward == 1.0, task
        assert observations[-1] == "done"
        assert all(re.fullmatch(r"= [0-9]+", o) for o in observations[1:-1]), observations


def test_worked_example_episode() -> None:
    # ann has 12, gets 7 more (19), then 3 times as many (57).
    chain = Chain(12, (Operation("+", 7), Operation("*", 3)))
    assert chain.reference() == ("calc[12+7]", "calc[19*3]", "answer[57]")
    assert chain.answer() == 57
    env = CalcEnv()
    observations, last = replay(env, make_task(), chain.reference())
    assert observations == ["q", "= 19", "= 57", "done"]
    assert last is not None and last.reward == 1.0


def test_split_sizes_ids_and_labels(suite: CalcSuite) -> None:
    train, eval_ = suite.tasks("train"), suite.tasks("eval")
    assert (len(train), len(eval_)) == (2000, 200)
    assert len({t.id for t in train + eval_}) == 2200
    assert {t.split for t in train} == {"train"} and {t.split for t in eval_} == {"eval"}
    labels = {f"ops={o},digits={d}" for o, d in DIFFICULTIES}
    assert len(labels) == 9
    for tasks in (train, eval_):
        counts = Counter(t.difficulty for t in tasks)
        assert set(counts) == labels
        assert max(counts.values()) - min(counts.values()) <= 1  # equal shares


def test_splits_are_disjoint_and_prompts_unique(suite: CalcSuite) -> None:
    train = {t.prompt for t in suite.tasks("train")}
    eval_ = {t.prompt for t in suite.tasks("eval")}
    assert len(train) == 2000 and len(eval_) == 200
    assert not train & eval_


def test_answers_are_whole_and_difficulty_matches_the_chain(suite: CalcSuite) -> None:
    for task in suite.tasks("train")[:300]:
        chain = chain_of(task)
        ops, digits = map(int, re.findall(r"[0-9]", task.difficulty))
        assert len(chain.operations) == ops
        assert int(task.answer) >= 0 and chain.answer() == int(task.answer)
        for o in chain.operations:  # the numbers the story introduces have `digits` digits
            assert len(str(o.operand)) == digits
        assert task.prompt.count(" . ") == ops + 1  # intro, one sentence per op, question


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 3))
def test_drawn_chains_keep_counts_whole_and_positive(seed: int, ops: int, digits: int) -> None:
    chain = draw_chain(np.random.default_rng(seed), ops, digits)
    value = chain.start
    for o in chain.operations:
        assert o.operand >= 2
        if o.op == "/":
            assert value % o.operand == 0
        value = {
            "+": value + o.operand,
            "-": value - o.operand,
            "*": value * o.operand,
            "/": value // o.operand,
        }[o.op]
        assert value >= 1
    assert chain.answer() == value


def test_generation_is_deterministic_by_seed() -> None:
    a, b, c = (CalcSuite(seed=s, train_size=50, eval_size=20) for s in (3, 3, 4))
    assert a.tasks("train") == b.tasks("train") and a.tasks("eval") == b.tasks("eval")
    assert a.tasks("train") != c.tasks("train")


def test_eval_does_not_move_with_train_size() -> None:
    small, large = CalcSuite(train_size=10), CalcSuite(train_size=500)
    assert small.tasks("eval") == large.tasks("eval")


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_turns must be >= 4"):
        CalcSuite(max_turns=3)
    with pytest.raises(ValueError, match="split sizes"):
        CalcSuite(train_size=-1)


# --- the env -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_", "reward"),
    [("57", 1.0), (" 57 ", 1.0), ("057", 1.0), ("+57", 1.0), ("58", 0.0), ("", 0.0)],
)
def test_answer_is_an_exact_integer(given_: str, reward: float) -> None:
    env = CalcEnv()
    env.reset(make_task())
    step = env.step(f"answer[{given_}]")
    assert step.done and step.reward == reward and step.observation == "done"


@pytest.mark.parametrize("given_", ["57.0", "fifty-seven", "5 7", "57!", "[57]", "5" * 5000])
def test_answer_text_that_is_not_an_integer_scores_zero(given_: str) -> None:
    assert not check_integer(given_, "57")


@pytest.mark.parametrize(
    ("action", "observation"),
    [
        ("calc[12+7]", "= 19"),
        ("I add them. calc[12 + 7]", "= 19"),  # a thought before the action is ignored
        ("calc[7/2]", "error: 7/2 is not a whole number"),
        ("calc[1/0]", "error: division by zero"),
        ("calc[]", "error: empty expression"),
        ("calc[__import__('os')]", "error: unexpected character '_' at 1"),
        ("calc[(1]", "error: expected ')' at 3"),
        ("search[apples]", "error: unknown tool search . use calc or answer"),
        ("calc 12+7", "error: no action . end the turn with calc[...] or answer[...]"),
        ("calc[12+7] done", "error: no action . end the turn with calc[...] or answer[...]"),
        ("", "error: no action . end the turn with calc[...] or answer[...]"),
    ],
)
def test_tool_results_and_errors_are_observations(action: str, observation: str) -> None:
    env = CalcEnv()
    env.reset(make_task())
    step = env.step(action)
    assert step == type(step)(observation, done=False, reward=0.0)


def test_a_turn_over_the_limit_is_refused_and_counts_as_a_turn() -> None:
    env = CalcEnv(max_turns=2, max_action_chars=12)
    env.reset(make_task())
    refused = env.step("I think. answer[57]")  # 19 characters: not read, so no answer
    assert refused == type(refused)("error: action longer than 12 characters", False, 0.0)
    assert env.step("calc[50+7]") == type(refused)(TURN_LIMIT, True, 0.0)  # 10: read
    with pytest.raises(ValueError, match="max_action_chars must be >= 1"):
        CalcEnv(max_action_chars=0)


def test_a_huge_answer_scores_zero_without_raising() -> None:
    env = CalcEnv()
    env.reset(make_task())
    assert env.step(f"answer[{'9' * 5000}]").reward == 0.0


def test_turn_limit_ends_with_zero_reward() -> None:
    env = CalcEnv(max_turns=3)
    env.reset(make_task())
    assert not env.step("calc[1+1]").done
    assert not env.step("oops").done
    last = env.step("calc[2+2]")
    assert (last.observation, last.done, last.reward) == (TURN_LIMIT, True, 0.0)


def test_an_answer_on_the_last_turn_still_counts() -> None:
    env = CalcEnv(max_turns=2)
    env.reset(make_task())
    env.step("calc[50+7]")
    assert env.step("answer[57]").reward == 1.0


def test_step_after_done_or_before_reset_is_a_programming_error() -> None:
    env = CalcEnv()
    with pytest.raises(ValueError, match="before reset"):
        env.step("answer[1]")
    env.reset(make_task())
    env.step("answer[1]")
    with pytest.raises(ValueError, match="after the episode ended"):
        env.step("answer[57]")
    env.reset(make_task())  # a reset starts over
    assert env.step("answer[57]").reward == 1.0


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_no_agent_text_raises(action: str) -> None:
    env = CalcEnv()
    env.reset(make_task())
    step = env.step(action)
    assert step.reward in (0.0, 1.0)


# --- demonstrations ------------------------------------------------------------------------------


def test_demonstrations_without_mistakes_are_the_reference(suite: CalcSuite) -> None:
    rng = np.random.default_rng(0)
    for task in suite.tasks("train")[:200]:
        assert suite.demonstration(task, rng, 0.0) == task.reference


def test_demonstrations_with_mistakes_never_succeed(suite: CalcSuite) -> None:
    env, rng = suite.make_env(), np.random.default_rng(1)
    for task in suite.tasks("train")[:300]:
        demo = suite.demonstration(task, rng, 1.0)
        observations, last = replay(env, task, demo)
        assert last is not None and last.done and last.reward == 0.0, demo
        assert not any(o.startswith("error") for o in observations), observations
        # It carries on from what it observed: each calc starts from the last result, or from
        # that result with one digit off (a slip in carrying it over).
        for turn, seen in zip(demo[1:-1], observations[1:-2], strict=True):
            carried = re.match(r"calc\[(-?[0-9]+)", turn)
            assert carried is not None
            assert digits_apart(carried.group(1), seen.removeprefix("= ")) <= 1, (turn, seen)


def digits_apart(a: str, b: str) -> int:
    """How many digit positions differ; a slip never changes a number's length."""
    assert len(a) == len(b), (a, b)
    return sum(x != y for x, y in zip(a, b, strict=True))


def test_demonstration_slips_look_like_slips() -> None:
    # ann has 12, gets 7 more, 3 times as many: every first-step slip is one small change.
    task = Task(
        "t", "q", "57", "ops=2,digits=2", "train", ("calc[12+7]", "calc[19*3]", "answer[57]")
    )
    suite = CalcSuite(train_size=0, eval_size=0)
    rng = np.random.default_rng(0)
    firsts = {suite.demonstration(task, rng, 1.0)[0] for _ in range(200)}
    assert firsts <= {
        "calc[12+12]", "calc[12+3]",  # a wrong number copied from the problem
        "calc[12+6]", "calc[12+8]",  # operand digit off by one
        "calc[11+7]", "calc[13+7]", "calc[2+7]", "calc[22+7]",  # carried number off by one
        "calc[12-7]", "calc[12*7]",  # wrong operator (12/7 is not whole, so never picked)
    }  # fmt: skip
    assert len(firsts) >= 6


def test_mistake_rates_grow_with_difficulty(suite: CalcSuite) -> None:
    rates = {t.difficulty: suite.mistake_rate_for(t) for t in suite.tasks("eval")}
    assert rates["ops=1,digits=1"] == 0.02 and rates["ops=3,digits=3"] == 0.6
    assert rates["ops=1,digits=2"] < rates["ops=2,digits=2"] < rates["ops=3,digits=2"]
    with pytest.raises(ValueError, match="not a calc label"):
        suite.mistake_rate_for(Task("x", "q", "1", "hard", "eval"))


@pytest.mark.slow
def test_demo_success_falls_with_difficulty(suite: CalcSuite) -> None:
    # 100 tasks per difficulty. Expected success (1 - rate) ** (ops + 1): 0.96 for the easiest,
    # 0.026 for the hardest; one binomial standard error at n=100 is at most 0.05.
    env, rng = suite.make_env(), np.random.default_rng(7)
    wins: Counter[str] = Counter()
    for task in suite.tasks("train")[:900]:
        demo = suite.demonstration(task, rng, suite.mistake_rate_for(task))
        _, last = replay(env, task, demo)
        wins[task.difficulty] += int(last is not None and last.reward == 1.0)
    assert wins["ops=1,digits=1"] >= 85
    assert wins["ops=3,digits=3"] <= 12
    assert 20 <= wins["ops=2,digits=2"] <= 65  # expected 0.75 ** 3 = 0.42


def test_demonstrations_are_deterministic_given_the_rng(suite: CalcSuite) -> None:
    tasks = suite.tasks("train")[:50]
    runs = [
        [suite.demonstration(t, np.random.default_rng(5), 0.5) for t in tasks] for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_demonstration_needs_a_calc_reference(suite: CalcSuite) -> None:
    with pytest.raises(ValueError, match="no scripted calc demonstration"):
        suite.demonstration(make_task(), np.random.default_rng(0), 0.0)
    with pytest.raises(ValueError, match=r"mistake_rate must be in \[0, 1\]"):
        suite.demonstration(suite.tasks("eval")[0], np.random.default_rng(0), 1.5)


def test_vocabulary_covers_the_texts_and_stays_small(suite: CalcSuite) -> None:
    texts = set(suite.vocabulary())
    for task in suite.tasks("train") + suite.tasks("eval"):
        assert task.prompt in texts
        assert set(task.reference) <= texts
    assert {"done", TURN_LIMIT, "error: division by zero"} <= texts
    words = {w for text in texts for w in re.findall(r"[a-z]+", text)}
    assert len(words) < 120, sorted(words)
