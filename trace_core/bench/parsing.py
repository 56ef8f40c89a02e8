"""``trace-rl bench parse``: reading the action off a model's turn, against the quadratic
definition it replaced, on texts shaped to be expensive.

    rows = run_parse_bench(reference_chars=8_000, large_chars=1_000_000)

For each hostile shape (``hostile``) the linear ``parse_action`` and the plain definition
(``reference_parse_action``: try every ``name[`` from the last, scan forward from each) read the
same text of ``reference_chars``; the ratio of their times is the speed-up there. The linear
parser (and BFCL's ``read_action``) also read a text of ``large_chars`` alone: the reference
would take hours on a megabyte of nested heads (its time quadruples when the text doubles).
Every result is checked against the action the shape holds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from trace_core.envs.base import Action, parse_action
from trace_core.envs.bfcl import read_action

REFERENCE_CHARS = 8_000
LARGE_CHARS = 1_000_000
_HEAD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[")


def reference_parse_action(text: str) -> Action | None:
    """The definition: the last ``name[`` (regex heads, left to right) whose brackets balance
    exactly to the final ``]``. Tries every head and scans forward from each: quadratic."""
    stripped = text.rstrip()
    if not stripped.endswith("]"):
        return None
    for head in reversed(list(_HEAD.finditer(stripped))):
        depth = 0
        for i in range(head.end() - 1, len(stripped)):
            depth += {"[": 1, "]": -1}.get(stripped[i], 0)
            if depth == 0:
                break
        if depth == 0 and i == len(stripped) - 1:
            return Action(head.group(1), stripped[head.end() : -1].strip())
    return None


def hostile(n: int, name: str = "a") -> dict[str, tuple[str, Action | None]]:
    """Texts of about ``n`` characters, each with the action it holds: shapes that cost the
    reference quadratic time (nested heads) or that push a scan to its far end."""
    k = n // 4
    return {
        "nested heads": (
            f"{name}[" * k + "]" * k,
            Action(name, f"{name}[" * (k - 1) + "]" * (k - 1)),
        ),
        "many heads, then an action": ("x[" * (2 * k) + "answer[42]", Action("answer", "42")),
        "many closed heads": ("x[] " * k + f"{name}[1]", Action(name, "1")),
        "deep brackets": ("[" * (2 * k) + "]" * (2 * k), None),
        "unbalanced": (f"{name}[" + "]" * (4 * k), None),
        "heads, one close": (f"{name}[" * (2 * k) + "]", Action(name, "")),
        "long name": ("x" * (4 * k) + "[]", Action("x" * (4 * k), "")),
        "digits before the bracket": ("7" * (4 * k) + "[]", None),
        "trailing spaces": (f"{name}[1]" + " " * (4 * k), Action(name, "1")),
        "a long thought": ("word " * k + f"{name}[1+2]", Action(name, "1+2")),
    }


@dataclass(frozen=True)
class ParseRow:
    shape: str
    reference_chars: int
    reference_seconds: float
    linear_seconds: float
    speedup: float
    """reference_seconds / linear_seconds, on the same text."""
    large_chars: int
    large_seconds: float
    """``parse_action`` alone on the large text."""
    bfcl_large_seconds: float
    """BFCL's ``read_action`` on the large text with its heads as ``call[``/``answer[``."""


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_parse_bench(
    reference_chars: int = REFERENCE_CHARS,
    large_chars: int = LARGE_CHARS,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[ParseRow]:
    """One row per hostile shape (module docstring); a wrong result raises AssertionError."""
    if reference_chars < 8 or large_chars < 8 or repeat < 1:
        raise ValueError("--reference-chars and --large-chars must be >= 8, --repeat >= 1")
    small, large = hostile(reference_chars), hostile(large_chars)
    bfcl_large = hostile(large_chars, name="answer")
    rows = []
    for shape, (text, expected) in small.items():
        if progress:
            progress(f"{shape}: reference at {reference_chars:,} characters")
        if reference_parse_action(text) != expected or parse_action(text) != expected:
            raise AssertionError(f"{shape}: a parser read {reference_chars:,} characters wrong")
        reference = _best(lambda t=text: reference_parse_action(t), repeat)
        linear = _best(lambda t=text: parse_action(t), repeat)
        big, big_expected = large[shape]
        if parse_action(big) != big_expected:
            raise AssertionError(f"{shape}: parse_action read {large_chars:,} characters wrong")
        big_seconds = _best(lambda t=big: parse_action(t), repeat)
        bfcl_seconds = _best(lambda t=bfcl_large[shape][0]: read_action(t), repeat)
        rows.append(
            ParseRow(
                shape,
                len(text),
                reference,
                linear,
                reference / max(linear, 1e-9),
                len(big),
                big_seconds,
                bfcl_seconds,
            )
        )
    return rows


def rows_to_json(rows: list[ParseRow]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]
