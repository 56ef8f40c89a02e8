"""``evaluate_policy``: pass@1 and mean@k counted by hand from a fake engine that answers four
calc tasks right or wrong in a known pattern.

The four tasks are two per difficulty (``CalcSuite(seed=0, eval_size=18)``, eval tasks 0, 9,
1, 10), each answered in one turn. Greedy answers are "right" (``answer[<answer>]``) or
"wrong" (``answer[0]``: no calc answer is 0); the k = 4 samples of a task follow its row of
``SAMPLED``, where "stall" calls ``calc[1+1]`` on every turn until the env's 6-turn limit ends
the episode with reward 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from trace_core.envs.base import Task
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.train.evaluate import ALL, evaluate_policy, paired_change

SUITE = CalcSuite(seed=0, train_size=0, eval_size=18)
TASKS = [SUITE.tasks("eval")[i] for i in (0, 9, 1, 10)]
FMT = TurnFormat(build_word_tokenizer(SUITE.vocabulary()))
D1, D2 = "ops=1,digits=1", "ops=1,digits=2"

GREEDY = {
    "calc-eval-00000": "right",
    "calc-eval-00009": "right",
    "calc-eval-00001": "right",
    "calc-eval-00010": "wrong",
}
SAMPLED = {
    "calc-eval-00000": ("right", "right", "right", "right"),
    "calc-eval-00009": ("right", "wrong", "stall", "right"),
    "calc-eval-00001": ("wrong", "right", "wrong", "stall"),
    "calc-eval-00010": ("stall", "wrong", "wrong", "wrong"),
}


def test_the_four_tasks_are_the_ones_counted_below() -> None:
    # Tokens of a turn: "answer [ 8 1 ] <|im_end|>" is 4 + (digits of the answer) tokens,
    # "calc [ 1 + 1 ] <|im_end|>" is 7.
    assert [(t.id, t.difficulty, t.answer) for t in TASKS] == [
        ("calc-eval-00000", D1, "81"),
        ("calc-eval-00009", D1, "2"),
        ("calc-eval-00001", D2, "186"),
        ("calc-eval-00010", D2, "77"),
    ]
    assert [len(FMT.action_ids(a)) for a in ("answer[81]", "answer[0]", "calc[1+1]")] == [6, 5, 7]


@dataclass
class KnownAnswers:
    """The ``Engine`` protocol: answers each task's first turn by ``GREEDY`` at temperature 0
    and by ``SAMPLED`` (one entry per sample) otherwise; a later turn only ever comes from a
    stalling episode, which stalls again. Every call's sampling parameters are kept."""

    stats: EngineStats = field(default_factory=EngineStats)
    params: list[SamplingParams] = field(default_factory=list)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int | None = None
    ) -> list[list[Completion]]:
        self.params.append(params)
        out = []
        for prompt in prompts:
            task = task_of(prompt)
            if len(prompt) > len(FMT.prompt_ids(task.prompt)):
                kinds: Sequence[str] = ("stall",)
            elif params.temperature == 0:
                kinds = (GREEDY[task.id],) * params.n
            else:
                kinds = SAMPLED[task.id]
                assert len(kinds) == params.n
            out.append([completion(action(kind, task)) for kind in kinds])
        return out


def task_of(prompt: Sequence[int]) -> Task:
    """The task whose prompt ``prompt`` starts with."""
    heads = [FMT.prompt_ids(t.prompt) for t in TASKS]
    return next(
        t for t, head in zip(TASKS, heads, strict=True) if list(prompt[: len(head)]) == head
    )


def action(kind: str, task: Task) -> str:
    return {"right": f"answer[{task.answer}]", "wrong": "answer[0]", "stall": "calc[1+1]"}[kind]


def completion(text: str) -> Completion:
    ids = np.asarray(FMT.action_ids(text), np.int32)
    return Completion(ids, np.zeros(len(ids), np.float32), finished=True)


def test_pass1_and_mean_k_by_hand() -> None:
    engine = KnownAnswers()
    report = evaluate_policy(engine, FMT, SUITE.make_env, TASKS, k=4, seed=0, max_tokens=9)
    # pass@1, greedy: right, right | right, wrong.
    #   ops=1,digits=1: (1 + 1) / 2 = 1.0;  ops=1,digits=2: (1 + 0) / 2 = 0.5;  all: 3/4
    assert report.pass1 == {D1: 1.0, D2: 0.5, ALL: 0.75}
    # mean@4: task 0 4/4, task 9 2/4 | task 1 1/4, task 10 0/4 (a stall scores 0).
    #   ops=1,digits=1: (1 + 0.5) / 2 = 0.75;  ops=1,digits=2: (0.25 + 0) / 2 = 0.125
    #   all: (1 + 0.5 + 0.25 + 0) / 4 = 0.4375
    assert report.mean_k == {D1: 0.75, D2: 0.125, ALL: 0.4375}
    assert (report.tasks, report.k) == (4, 4)
    # Tokens. Greedy: answer[81] 6 + answer[2] 5 + answer[186] 7 + answer[0] 5 = 23.
    # Sampled (a stall is 6 turns × 7 = 42):
    #   task 0:  4 × 6            = 24
    #   task 9:  5 + 5 + 42 + 5   = 57
    #   task 1:  5 + 7 + 5 + 42   = 59
    #   task 10: 42 + 5 + 5 + 5   = 57       23 + 24 + 57 + 59 + 57 = 220
    assert report.tokens == 220
    assert report.as_dict() == {
        "tasks": 4,
        "k": 4,
        "pass1": {D1: 1.0, D2: 0.5, ALL: 0.75},
        "mean_k": {D1: 0.75, D2: 0.125, ALL: 0.4375},
        "parse_rate": 1.0,  # right, wrong and stall are all actions
        "truncated": 0.0,  # every turn ended with <|im_end|>
        # Each task's results, in the order of the tasks: what a paired comparison reads.
        "per_task": {
            "ids": ["calc-eval-00000", "calc-eval-00009", "calc-eval-00001", "calc-eval-00010"],
            "pass1": [1.0, 1.0, 1.0, 0.0],
            "mean_k": [1.0, 0.5, 0.25, 0.0],
        },
    }
    # First call greedy (one sample), then the k samples at temperature 1; each stalling
    # episode's 5 later turns come one sample at a time; every call stops at <|im_end|>.
    first, sampled, *later = engine.params
    assert (first.n, first.temperature, first.max_tokens) == (1, 0.0, 9)
    assert (sampled.n, sampled.temperature, sampled.max_tokens) == (4, 1.0, 9)
    assert len(later) == 5 and all(p.n == 1 and p.temperature == 1.0 for p in later)
    assert {p.stop_token_ids for p in engine.params} == {(FMT.end_of_turn_id,)}


def test_a_task_whose_env_fails_is_left_out_in_one_line() -> None:
    """A retrieval service that stays down fails one task's env on its searches (``calc[...]``
    here; task 1 stalls on them in one of its samples): that task is left out of every figure,
    named with the error's one line, and the evaluation goes on; when every task fails, it
    stops naming one."""
    from trace_core.envs.remote import RetrieverUnavailable

    class DownOnCalc:
        def __init__(self, inner: object, down: set[str], on: str) -> None:
            self.inner, self.down, self.on, self.task = inner, down, on, ""

        def reset(self, task: Task) -> str:
            self.task = task.id
            return self.inner.reset(task)  # type: ignore[attr-defined, no-any-return]

        def step(self, action: str):  # type: ignore[no-untyped-def]
            if self.task in self.down and action.startswith(self.on):
                raise RetrieverUnavailable("retriever http://r:8000: no answer after 5 attempts")
            return self.inner.step(action)  # type: ignore[attr-defined]

    def make_env(down: set[str], on: str = "calc["):  # type: ignore[no-untyped-def]
        return lambda: DownOnCalc(SUITE.make_env(), down, on)

    report = evaluate_policy(KnownAnswers(), FMT, make_env({"calc-eval-00001"}), TASKS, k=4, seed=0)
    line = "RetrieverUnavailable: retriever http://r:8000: no answer after 5 attempts"
    assert report.left_out == (("calc-eval-00001", line),)
    assert report.as_dict()["left_out"] == [["calc-eval-00001", line]]
    assert report.task_ids == ("calc-eval-00000", "calc-eval-00009", "calc-eval-00010")
    # The other three as counted above: pass@1 1, 1, 0; mean@4 1, 0.5, 0.
    assert report.pass1 == {D1: 1.0, D2: 0.0, ALL: 2 / 3}
    assert report.mean_k == {D1: 0.75, D2: 0.0, ALL: 0.5}
    every = {t.id for t in TASKS}
    with pytest.raises(RuntimeError, match="every held-out task's env failed; task calc-eval"):
        evaluate_policy(KnownAnswers(), FMT, make_env(every, on=""), TASKS, k=4, seed=0)


def test_k_zero_evaluates_greedy_only() -> None:
    engine = KnownAnswers()
    report = evaluate_policy(engine, FMT, SUITE.make_env, TASKS, k=0, seed=0)
    assert report.pass1 == {D1: 1.0, D2: 0.5, ALL: 0.75}
    assert report.mean_k == {}
    assert report.tokens == 23  # the greedy answers alone (above)
    assert [p.temperature for p in engine.params] == [0.0]


def test_rejects_no_tasks_and_negative_k() -> None:
    with pytest.raises(ValueError, match="no eval tasks"):
        evaluate_policy(KnownAnswers(), FMT, SUITE.make_env, [], k=1, seed=0)
    with pytest.raises(ValueError, match="k must be >= 0, got -1"):
        evaluate_policy(KnownAnswers(), FMT, SUITE.make_env, TASKS, k=-1, seed=0)


@dataclass
class CutFirstTurn(KnownAnswers):
    """``KnownAnswers``, but task 10's greedy first turn is "answer" cut by the token limit:
    no action, no end-of-turn token."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int | None = None
    ) -> list[list[Completion]]:
        out = super().generate(prompts, params, seed)
        for i, prompt in enumerate(prompts):
            first = len(prompt) == len(FMT.prompt_ids(task_of(prompt).prompt))
            if first and params.temperature == 0 and task_of(prompt).id == "calc-eval-00010":
                ids = np.asarray(FMT.tokenizer.encode("answer"), np.int32)
                out[i] = [Completion(ids, np.zeros(len(ids), np.float32), finished=False)]
        return out


def test_parse_rate_and_cut_turns_by_hand() -> None:
    report = evaluate_policy(CutFirstTurn(), FMT, SUITE.make_env, TASKS, k=0, seed=0)
    # Tasks 0, 9 and 1 answer in one parsable turn each (3 turns). Task 10's first turn is cut
    # and unparsable; the env answers it with an error and the episode goes on, every later
    # turn a stall (calc[1+1], parsable) up to the 6-turn limit: 1 + 5 turns.
    #   parse rate: (3 + 5) / 9 = 8/9;  cut: 1/9
    assert report.parse_rate == pytest.approx(8 / 9)
    assert report.truncated == pytest.approx(1 / 9)
    assert report.pass1 == {D1: 1.0, D2: 0.5, ALL: 0.75}


def test_paired_change_by_hand() -> None:
    """final − start per task: (0, -1, +1, +1) → mean 0.25; sd of the differences
    = sqrt(((−.25)² + (−1.25)² + .75² + .75²) / 3) = sqrt(2.75 / 3) = 0.9574;
    half-width 1.96 × 0.9574 / 2 = 0.9383."""
    ids = ["a", "b", "c", "d"]
    start = {"per_task": {"ids": ids, "pass1": [1.0, 1.0, 0.0, 0.0], "mean_k": [0.5] * 4}}
    final = {"per_task": {"ids": ids, "pass1": [1.0, 0.0, 1.0, 1.0], "mean_k": [0.5] * 4}}
    change = paired_change(start, final, "pass1")
    assert change is not None and change.tasks == 4
    assert change.mean == 0.25
    assert change.low == pytest.approx(0.25 - 0.9383, abs=1e-4)
    assert change.high == pytest.approx(0.25 + 0.9383, abs=1e-4)
    assert change.text() == "+0.250 [-0.688, +1.188]"
    same = paired_change(start, final, "mean_k")
    assert same is not None and (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    # Other tasks, or a report without per-task results (written before they were kept): none.
    other = {"per_task": {**final["per_task"], "ids": ["a", "b", "c", "e"]}}
    assert paired_change(start, other, "pass1") is None
    assert paired_change({"pass1": {"all": 0.5}}, final, "pass1") is None
