"""Arithmetic word problems solved with a calculator tool.

One episode of the built-in suite (``CalcSuite``), observations after ``->``:

    ann has 12 apples . she gets 7 more . she now has 3 times as many .
      how many apples does she have ?                  (one line in the prompt)
    calc[12+7]   -> = 19
    calc[19*3]   -> = 57
    answer[57]   -> done            (reward 1)

Difficulty is ``ops`` (1-3 operations chained on a running count) times ``digits`` (1-3 digits in
every operand; the starting count has as many, or is the product of two such numbers when the
first operation divides). Every intermediate count is a whole number >= 1: subtraction never
goes below one and division always divides evenly. The text is short, lower case and
space-separated so that a tiny word-level policy trained from scratch can learn it from the
scripted demonstrations (``CalcSuite.demonstration``), whose controlled slips make hard problems
fail more often than easy ones.

``CalcEnv`` takes the answer check as an argument (``check_integer`` here); the DeepScaleR suite
(``deepscaler``) runs its problems in the same env with a math-verify check, and with its own
turn length limit (``max_action_chars``; ``MAX_ACTION_CHARS`` here).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from trace_core.envs.base import (
    DONE,
    TURN_LIMIT,
    EpisodeState,
    Split,
    Step,
    Task,
    ToolTimeout,
    bounded_call,
    parse_action,
    refuse_long,
)
from trace_core.envs.calculator import MAX_MAGNITUDE, CalcError, evaluate

NAMES = (
    ("ann", "she"),
    ("bob", "he"),
    ("cal", "he"),
    ("dee", "she"),
    ("eve", "she"),
    ("fay", "she"),
    ("gus", "he"),
    ("hal", "he"),
)
ITEMS = ("apples", "pens", "cards", "coins", "eggs", "books", "shells", "stamps")
# One sentence per operation on the running count ("{p}" is the pronoun, "{b}" the operand).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": ("{p} gets {b} more .", "{p} buys {b} more .", "{p} finds {b} more ."),
    "-": ("{p} gives away {b} .", "{p} loses {b} .", "{p} sells {b} ."),
    "*": ("{p} now has {b} times as many .", "each one turns into {b} ."),
    "/": (
        "{p} keeps one of every {b} .",
        "{p} splits them into {b} piles and keeps one .",
    ),
}
OPS = tuple(TEMPLATES)
DIFFICULTIES = tuple((ops, digits) for ops in (1, 2, 3) for digits in (1, 2, 3))

# Per-action slip probability of the demonstrations, by ops + digits - 2 (0 easiest .. 4 hardest).
# A demo of `ops` operations takes ops + 1 actions, so it succeeds with probability
# (1 - rate) ** (ops + 1): 0.96 for ops=1,digits=1, about 0.4 in the middle, 0.03 for
# ops=3,digits=3.
_SLIP_RATES = (0.02, 0.1, 0.25, 0.4, 0.6)

_DIFFICULTY = re.compile(r"ops=([1-3]),digits=([1-3])")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_CALC_TURN = re.compile(r"calc\[([0-9]+)([-+*/])([0-9]+)\]")

NO_ACTION = "error: no action . end the turn with calc[...] or answer[...]"
INSTRUCTIONS = (
    "Solve the word problem with a calculator. In each turn, think briefly, then end the turn "
    "with exactly one action: calc[expression] evaluates an arithmetic expression (whole "
    "numbers, + - * / and parentheses) and shows the result; answer[number] gives the final "
    "answer and ends the episode. Example turn: 12 plus 7 first. calc[12+7]"
)
"""The system prompt of a pretrained policy: the action grammar (``policy.format``)."""
MAX_ACTION_CHARS = 2_000
"""Longest turn (thought and action) the calc env reads. The longest reference or demonstration
turn is 22 characters (``calc[...]`` itself takes at most ``calculator.MAX_CHARS`` = 200), so
this leaves room for a thought of a few hundred words."""

AnswerCheck = Callable[[str, str], bool]
"""``check(given, gold)``: whether the agent's answer text is right."""


def check_integer(given: str, gold: str) -> bool:
    """Exact integer match, ignoring surrounding spaces and leading zeros ("057" == "57")."""
    given = given.strip()
    # The length cap keeps int() away from Python's 4300-digit conversion limit, which raises.
    return len(given) <= 40 and bool(_INTEGER.fullmatch(given)) and int(given) == int(gold)


class CalcEnv:
    """``calc[expression]`` answers ``= value``; ``answer[x]`` ends the episode.

    A turn longer than ``max_action_chars`` is refused unread, as a malformed one is: the
    observation says so and the episode goes on.
    """

    def __init__(
        self,
        max_turns: int = 6,
        check: AnswerCheck = check_integer,
        max_action_chars: int = MAX_ACTION_CHARS,
    ) -> None:
        if max_turns < 1 or max_action_chars < 1:
            raise ValueError(
                f"max_turns and max_action_chars must be >= 1, got {max_turns}, {max_action_chars}"
            )
        self.max_turns = max_turns
        self.check = check
        self.max_action_chars = max_action_chars
        self._episode = EpisodeState()

    def reset(self, task: Task) -> str:
        self._episode.start(task)
        return task.prompt

    def step(self, action: str) -> Step:
        task = self._episode.begin_step()
        refusal = refuse_long(action, self.max_action_chars)
        if refusal is not None:
            return self._episode.observe(refusal, self.max_turns)
        parsed = parse_action(action)
        if parsed is not None and parsed.name == "answer":
            return self._episode.finish(self.check(parsed.argument, task.answer))
        if parsed is None:
            observation = NO_ACTION
        elif parsed.name == "calc":
            observation = _calculate(parsed.argument)
        else:
            observation = f"error: unknown tool {parsed.name} . use calc or answer"
        return self._episode.observe(observation, self.max_turns)


def _calculate(expr: str) -> str:
    try:
        return f"= {bounded_call(lambda: evaluate(expr))}"
    except (CalcError, ToolTimeout) as err:
        return f"error: {err}"


@dataclass(frozen=True)
class Operation:
    op: str
    """One of + - * /."""
    operand: int


@dataclass(frozen=True)
class Chain:
    """A word problem's arithmetic: a starting count and the operations applied to it."""

    start: int
    operations: tuple[Operation, ...]

    def __post_init__(self) -> None:
        if not self.operations:
            raise ValueError("a chain needs at least one operation")
        if any(o.op not in OPS for o in self.operations):
            raise ValueError(f"operations must be among {OPS}, got {self.operations}")

    def numbers(self) -> tuple[int, ...]:
        """Every number the problem text mentions."""
        return (self.start, *(o.operand for o in self.operations))

    def answer(self) -> int:
        value = _run(self.start, self.operations)
        if value is None:
            raise ValueError(f"chain {self} does not evaluate to a whole number")
        return value

    def reference(self) -> tuple[str, ...]:
        """The scripted demonstration: one calc per operation on the last result, then answer."""
        turns, value = [], self.start
        for o in self.operations:
            expr = f"{value}{o.op}{o.operand}"
            turns.append(f"calc[{expr}]")
            value = evaluate(expr)
        return (*turns, f"answer[{value}]")


def _run(value: int, operations: Sequence[Operation]) -> int | None:
    """Apply ``operations`` to ``value``; None when a division leaves a remainder or overflows."""
    for o in operations:
        try:
            value = evaluate(f"{value}{o.op}{o.operand}")
        except CalcError:
            return None
    return value


def chain_of(task: Task) -> Chain:
    """Read a task's chain back from its scripted reference (``calc[a+b]`` turns, then answer)."""
    calcs = [_CALC_TURN.fullmatch(turn) for turn in task.reference[:-1]]
    if not calcs or None in calcs or not task.reference[-1].startswith("answer["):
        raise ValueError(f"task {task.id} has no scripted calc demonstration")
    matches = [m for m in calcs if m is not None]
    chain = Chain(
        int(matches[0].group(1)), tuple(Operation(m.group(2), int(m.group(3))) for m in matches)
    )
    if chain.reference() != task.reference:
        raise ValueError(f"task {task.id}: its reference is not a consistent calc chain")
    return chain


def draw_chain(rng: np.random.Generator, ops: int, digits: int) -> Chain:
    """A random chain whose numbers have ``digits`` digits and whose counts stay whole and >= 1.

    Operands are at least 2 (x1 and /1 are no operation). Later operations are drawn among those
    that keep the count valid: subtraction needs count > operand, division an exact divisor.
    """
    lo, hi = max(2, 10 ** (digits - 1)), 10**digits - 1

    def number(low: int = lo, high: int = hi) -> int:
        return int(rng.integers(low, high + 1))

    first = OPS[int(rng.integers(len(OPS)))]
    if first == "/":
        operand = number()
        start = operand * number()
    elif first == "-":
        operand = number(lo, hi - 1)
        start = number(operand + 1, hi)
    else:
        start, operand = number(), number()
    operations = [Operation(first, operand)]
    value = _run(start, operations)
    assert value is not None
    while len(operations) < ops:
        op = OPS[int(rng.integers(len(OPS)))]
        divisors = [b for b in range(lo, min(hi, value) + 1) if value % b == 0] if op == "/" else []
        if (op == "-" and value <= lo) or (op == "/" and not divisors):
            op = ("+", "*")[int(rng.integers(2))]
        if op == "-":
            operand = number(lo, min(hi, value - 1))
        elif op == "/":
            operand = divisors[int(rng.integers(len(divisors)))]
        else:
            operand = number()
        operations.append(Operation(op, operand))
        value = _run(value, operations[-1:])
        assert value is not None
    return Chain(start, tuple(operations))


def render(chain: Chain, rng: np.random.Generator) -> str:
    """The word problem: who holds how many of what, one sentence per operation, the question."""
    name, pronoun = NAMES[int(rng.integers(len(NAMES)))]
    item = ITEMS[int(rng.integers(len(ITEMS)))]
    sentences = [f"{name} has {chain.start} {item} ."]
    for o in chain.operations:
        templates = TEMPLATES[o.op]
        template = templates[int(rng.integers(len(templates)))]
        sentences.append(template.format(p=pronoun, b=o.operand))
    sentences.append(f"how many {item} does {pronoun} have ?")
    return " ".join(sentences)


def _digit_slips(number: int) -> list[int]:
    """``number`` with one digit one higher or lower (no new leading zero)."""
    text, slips = str(abs(number)), []
    for i, char in enumerate(text):
        for delta in (-1, 1):
            digit = int(char) + delta
            if 0 <= digit <= 9 and not (digit == 0 and i == 0 and len(text) > 1):
                changed = int(text[:i] + str(digit) + text[i + 1 :])
                slips.append(-changed if number < 0 else changed)
    return slips


class CalcSuite:
    """Seeded arithmetic word problems; all nine (ops, digits) difficulties in equal shares."""

    name = "calc"
    instructions = INSTRUCTIONS

    def __init__(
        self, seed: int = 0, train_size: int = 2000, eval_size: int = 200, max_turns: int = 6
    ) -> None:
        if train_size < 0 or eval_size < 0:
            raise ValueError(f"split sizes must be >= 0, got {train_size=} {eval_size=}")
        if max_turns < 4:
            raise ValueError(
                f"max_turns must be >= 4 (3 operations and an answer), got {max_turns}"
            )
        self.seed, self.max_turns = seed, max_turns
        seen: set[str] = set()
        # Eval is drawn first, from its own stream, so that its problems do not move when
        # train_size changes; train then skips any prompt already used.
        self._tasks: dict[Split, list[Task]] = {}
        plan: tuple[tuple[Split, int, int], ...] = (
            ("eval", eval_size, 1),
            ("train", train_size, 0),
        )
        for split, size, stream in plan:
            rng = np.random.default_rng([seed, stream])
            self._tasks[split] = [self._draw_task(rng, split, i, seen) for i in range(size)]

    def difficulty(self, i: int) -> tuple[int, int]:
        """(ops, digits) of a split's ``i``-th task: the nine in turn."""
        return DIFFICULTIES[i % len(DIFFICULTIES)]

    def _draw_task(self, rng: np.random.Generator, split: Split, i: int, seen: set[str]) -> Task:
        ops, digits = self.difficulty(i)
        for _ in range(1000):
            chain = draw_chain(rng, ops, digits)
            prompt = render(chain, rng)
            if prompt not in seen:
                seen.add(prompt)
                return Task(
                    id=f"{self.name}-{split}-{i:05d}",
                    prompt=prompt,
                    answer=str(chain.answer()),
                    difficulty=f"ops={ops},digits={digits}",
                    split=split,
                    reference=chain.reference(),
                )
        raise ValueError(f"ran out of distinct ops={ops},digits={digits} problems; ask for fewer")

    def tasks(self, split: Split) -> list[Task]:
        return list(self._tasks[split])

    def make_env(self) -> CalcEnv:
        return CalcEnv(self.max_turns)

    def mistake_rate_for(self, task: Task) -> float:
        """Per-action slip probability for demonstrations of ``task``, rising with difficulty."""
        match = _DIFFICULTY.fullmatch(task.difficulty)
        if match is None:
            raise ValueError(f"task {task.id}: difficulty {task.difficulty!r} is not a calc label")
        return _SLIP_RATES[int(match.group(1)) + int(match.group(2)) - 2]

    def demonstration(
        self, task: Task, rng: np.random.Generator, mistake_rate: float
    ) -> tuple[str, ...]:
        """The scripted turns, each action slipping with probability ``mistake_rate``.

        A slip is what a careless solver does: copy a wrong number from the problem, get a digit
        off by one (in the operand or the carried result), or use a wrong operator. The demo then
        carries on correctly from the (wrong) value it observed, so one slip makes the final
        answer wrong; slips that would land on the right answer anyway, or lead to a division
        with a remainder later, are never picked. The answer itself can slip a digit too, so
        ``mistake_rate=1`` never succeeds and ``mistake_rate=0`` always does.
        """
        if not 0.0 <= mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate must be in [0, 1], got {mistake_rate}")
        chain = chain_of(task)
        truth = chain.answer()
        turns: list[str] = []
        value = chain.start
        for i, o in enumerate(chain.operations):
            expr = f"{value}{o.op}{o.operand}"
            if rng.random() < mistake_rate:
                rest = chain.operations[i + 1 :]
                slips = [s for s in _slips(value, o, chain.numbers()) if _wrong(s, rest, truth)]
                if slips:
                    expr = slips[int(rng.integers(len(slips)))]
            turns.append(f"calc[{expr}]")
            value = evaluate(expr)
        if rng.random() < mistake_rate:
            answers = [n for n in (*_digit_slips(value), value + 1, value - 1) if n != truth]
            answers = list(dict.fromkeys(answers))
            value = answers[int(rng.integers(len(answers)))]
        return (*turns, f"answer[{value}]")

    def vocabulary(self) -> list[str]:
        """Every distinct text of the suite's episodes: prompts of both splits, reference turns and
        their observations, and the env's answers to common agent errors. Build a tokenizer from
        these (numbers are split into digits downstream); slipped demos use the same words."""
        texts: set[str] = {DONE, TURN_LIMIT}
        for split in ("train", "eval"):
            for task in self._tasks[split]:
                texts.add(task.prompt)
                texts.update(task.reference)
                # what the env answers each calc turn, computed directly (same text, no thread)
                texts.update(f"= {evaluate(t[5:-1])}" for t in task.reference[:-1])
        env = self.make_env()
        probe = self._tasks["train"][0] if self._tasks["train"] else None
        if probe is not None:
            bad = ["calc[7/2]", "calc[1/0]", "calc[]", "calc[1+]", "calc[(1]", "calc[x]"]
            bad += [f"calc[{'9' * 13}]", f"calc[{'9' * 12}*{'9' * 12}]", "search[x]", "hello"]
            for action in bad:
                env.reset(probe)
                texts.add(env.step(action).observation)
        return sorted(texts)


def _slips(value: int, o: Operation, numbers: Sequence[int]) -> list[str]:
    """Expressions a careless solver might write instead of ``value o.op o.operand``."""
    exprs = [f"{value}{o.op}{n}" for n in numbers if n != o.operand]  # wrong number copied
    exprs += [f"{value}{o.op}{n}" for n in _digit_slips(o.operand)]  # operand digit off by one
    exprs += [f"{v}{o.op}{o.operand}" for v in _digit_slips(value)]  # carried result off by one
    exprs += [f"{value}{op}{o.operand}" for op in OPS if op != o.op]  # wrong operator
    return list(dict.fromkeys(exprs))


def _wrong(expr: str, rest: Sequence[Operation], truth: int) -> bool:
    """Whether ``expr`` evaluates, and carrying on correctly from it ends on a wrong answer."""
    try:
        value = evaluate(expr)
    except CalcError:
        return False
    final = _run(value, rest)
    return final is not None and final != truth and abs(final) <= MAX_MAGNITUDE


# calc-mix: of every 20 tasks, 10 of the easiest level, 5 of the hardest, 5 in between.
MIX = (((1, 1), 10), ((3, 3), 5), ((1, 2), 2), ((2, 2), 3))
MIX_SCHEDULE = tuple(level for level, count in MIX for _ in range(count))
HARDEST_SLIP_RATE = 0.9
"""calc-mix's per-action slip rate on its hardest level: a demonstration is right 1 time in 10⁴."""


class CalcMixSuite(CalcSuite):
    """calc in the regime the paper measures TRACE in: most prompts saturated, some in between.

    Of every 20 tasks (train and eval alike, so the held-out split has the same mix), 10 are
    ops=1,digits=1, 5 are ops=3,digits=3, 2 are ops=1,digits=2 and 3 are ops=2,digits=2.
    The easiest level's demonstrations never slip, so the warm-started policy solves nearly all
    of those (a group of rollouts all succeeds). The hardest level's slip at every action but
    one in ten, so those stay beyond the policy, as competition problems are beyond a small
    model: a group all fails, and keeps failing through training. The five in between slip as
    calc's do and are where rewards disagree: the regime where the paper measures GRPO's
    prompt effective ratio at 26.8% (math, Qwen3-8B).

    calc-mix's runs warm-start for 2,000 SFT steps unless told otherwise
    (``train.config.warmstart_steps``), where the easiest level saturates.
    ``docs/results.md`` holds GRPO's prompt effective ratio on this mix, per iteration, over
    five seeds.
    """

    name = "calc-mix"

    def difficulty(self, i: int) -> tuple[int, int]:
        return MIX_SCHEDULE[i % len(MIX_SCHEDULE)]

    def mistake_rate_for(self, task: Task) -> float:
        if task.difficulty == "ops=1,digits=1":
            return 0.0
        if task.difficulty == "ops=3,digits=3":
            return HARDEST_SLIP_RATE
        return super().mistake_rate_for(task)
