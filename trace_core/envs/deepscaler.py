"""DeepScaleR math problems in the calc env, their answers checked with math-verify.

    trace-rl task check deepscaler --data train.parquet

The data is JSON, JSON Lines or Parquet with ``problem`` and ``answer`` (``solution`` optional).
Episodes run in ``CalcEnv``, so the calculator stays available; the answer is compared with the
gold one by mathematical equivalence (``check_math``) instead of as an integer.

math-verify's work on a short hostile answer is unbounded (``x^x^...^2`` of 33 characters keeps
sympy busy for seconds), so the check runs in a child process that is killed past its time bound
(``check_math``); answers longer than ``MAX_ANSWER_CHARS`` are not checked at all.
"""

from __future__ import annotations

import numpy as np

from trace_core.envs.base import Split, Task, ToolTimeout, parse_action
from trace_core.envs.calc import CalcEnv
from trace_core.envs.isolated import IsolatedCall, IsolatedError
from trace_core.envs.source import read_records

MAX_ACTION_CHARS = 64_000
"""Longest turn (thought and action) the env reads: DeepScaleR models reason at length before
they answer, and about 16k tokens of thought (some 4 characters each) fit. The references are
``answer[<gold>]`` alone, at most ``MAX_ANSWER_CHARS`` + 8 characters."""
MAX_ANSWER_CHARS = 1_000
INSTRUCTIONS = (
    "Solve the math problem. Reason step by step; you may use a calculator: end a turn with "
    "calc[expression] to evaluate arithmetic (+ - * / and parentheses). When you are done, end "
    "the turn with answer[final answer] (a number or LaTeX expression); it ends the episode."
)
"""The system prompt of a pretrained policy: the action grammar (``policy.format``)."""
"""Longest answer math-verify is given; a longer one is wrong unread. Its time grows faster than
the length (measured: 8,000 characters take about 3 s, 60,000 about 40 s, on a thread that
outlives its time bound); gold answers are short formulas, and one over the bound gets no
reference."""


def check_math(given: str, gold: str, seconds: float = 5.0) -> bool:
    """Mathematical equivalence by math-verify ("\\frac{1}{2}" == "0.5"), gold parsed first.

    Both sides are read as inline LaTeX (``$...$``), falling back to the raw text when that finds
    nothing. The check runs in a child process (``envs.isolated``) that is killed past
    ``seconds``: math-verify's time on a short hostile answer (``x^x^...^2``) is unbounded, and a
    thread could only stop waiting for it. Any failure counts as wrong, and so does an answer
    longer than ``MAX_ANSWER_CHARS``.
    """
    if len(given.strip()) > MAX_ANSWER_CHARS:
        return False
    try:
        return _checker(seconds)(verify_math, given, gold)
    except (ToolTimeout, IsolatedError):  # odd input failing or running away: a wrong answer
        return False


_CHECKERS: dict[float, IsolatedCall] = {}


def _checker(seconds: float) -> IsolatedCall:
    """One checking process per time bound, per process, started on first use."""
    if seconds not in _CHECKERS:
        _CHECKERS[seconds] = IsolatedCall(seconds, preload=(__name__, "math_verify"))
    return _CHECKERS[seconds]


def verify_math(given: str, gold: str) -> bool:
    """math-verify's verdict, unbounded: call it through ``check_math``."""
    import math_verify  # heavy (sympy); only DeepScaleR needs it

    def parse(text: str) -> list[object]:
        text = text.strip()
        if not text:
            return []
        parsed = list(math_verify.parse(f"${text}$", parsing_timeout=None))
        return parsed or list(math_verify.parse(text, parsing_timeout=None))

    gold_parsed, given_parsed = parse(gold), parse(given)
    if not gold_parsed or not given_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, given_parsed, timeout_seconds=None))


def load_deepscaler(uri: str, split_seed: int = 0, eval_fraction: float = 0.1) -> list[Task]:
    """DeepScaleR problems (``problem``, ``answer``, optional ``solution``) from JSON/JSONL/Parquet.

    A seeded permutation puts ``round(eval_fraction * n)`` rows in eval, the rest in train. The
    reference is the single turn ``answer[<gold>]`` (empty when the gold text has unbalanced
    brackets and so cannot be written as one action, or is longer than ``MAX_ANSWER_CHARS``).
    Ids are ``deepscaler-<row>``.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    rows = read_records(uri)
    if not rows:
        raise ValueError(f"{uri}: no rows")
    problems: list[tuple[str, str]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{uri}: row {i} is a {type(row).__name__}, expected an object")
        for field in ("problem", "answer"):
            if field not in row or row[field] is None:
                raise ValueError(f"{uri}: row {i} has no {field!r} field")
        problem, answer = row["problem"], row["answer"]
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{uri}: row {i} field 'problem' must be non-empty text")
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(f"{uri}: row {i} field 'answer' must be non-empty text or an integer")
        solution = row.get("solution")
        if solution is not None and not isinstance(solution, str):
            raise ValueError(f"{uri}: row {i} field 'solution' must be text when present")
        problems.append((problem.strip(), answer.strip()))
    order = np.random.default_rng(split_seed).permutation(len(rows))
    eval_rows = set(order[: round(eval_fraction * len(rows))].tolist())
    tasks = []
    for i, (problem, answer) in enumerate(problems):
        action = f"answer[{answer}]"
        parsed = parse_action(action)
        writable = parsed is not None and parsed.argument == answer
        reference = (action,) if writable and len(answer) <= MAX_ANSWER_CHARS else ()
        split: Split = "eval" if i in eval_rows else "train"
        tasks.append(Task(f"deepscaler-{i}", problem, answer, "deepscaler", split, reference))
    return tasks


class DeepScaleRSuite:
    """DeepScaleR problems in ``CalcEnv`` (the calculator stays available), math-verify rewards.

    Turns up to ``MAX_ACTION_CHARS`` are read, longer ones refused as in any ``CalcEnv``.
    """

    name = "deepscaler"
    instructions = INSTRUCTIONS

    def __init__(
        self, uri: str, split_seed: int = 0, eval_fraction: float = 0.1, max_turns: int = 6
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.uri, self.max_turns = uri, max_turns
        self._tasks = load_deepscaler(uri, split_seed, eval_fraction)

    def tasks(self, split: Split) -> list[Task]:
        return [t for t in self._tasks if t.split == split]

    def make_env(self) -> CalcEnv:
        return CalcEnv(self.max_turns, check=check_math, max_action_chars=MAX_ACTION_CHARS)
