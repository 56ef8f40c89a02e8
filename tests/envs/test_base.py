"""Reading a turn: ``parse_action`` against the plain (quadratic) definition it replaced
(``bench.parsing``), its reads counted, megabyte texts of hostile shapes, and the turn length
refusal."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.bench.parsing import hostile, reference_parse_action
from trace_core.envs.base import Action, find_matching_open, parse_action, refuse_long


class CountingText(str):
    """A text that counts its reads: each ``text[i]`` and each slice is one."""

    reads = 0

    def __getitem__(self, key: int | slice) -> str:  # type: ignore[override]
        self.reads += 1
        return super().__getitem__(key)


MEGABYTE = hostile(1_000_000)
CHUNKS = ["a[", "x1[", "_[", "12[", "ab", "b", "1", "[", "]", "]]", " ", "\n", "é["]
texts = st.one_of(
    st.text(alphabet="ab_[] 1x\n", max_size=40),
    st.lists(st.sampled_from(CHUNKS), max_size=30).map("".join),
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("calc[1+2]", Action("calc", "1+2")),
        ("I add them.\nsearch[bo lin born]  \n", Action("search", "bo lin born")),
        ("answer[a [b] c]", Action("answer", "a [b] c")),
        ("answer[ 42 ]", Action("answer", "42")),
        ("calc[]", Action("calc", "")),
        ("x1ab[y]", Action("x1ab", "y")),
        ("12ab[y]", Action("ab", "y")),  # a name starts at a letter or underscore
        ("a[b[c]", Action("b", "c")),  # the first a[ is never closed
        ("éa[y]", Action("a", "y")),  # names are ASCII
        ("12[y]", None),
        ("é[y]", None),
        ("[y]", None),
        ("a[b]]", None),
        ("calc[1] done", None),
        ("", None),
        ("]", None),
    ],
)
def test_parse_action_worked_examples(text: str, expected: Action | None) -> None:
    assert parse_action(text) == expected == reference_parse_action(text)


def test_parse_action_equals_the_reference_on_every_short_text() -> None:
    for size in range(7):  # 55,987 texts
        for chars in itertools.product("a1_[] ", repeat=size):
            text = "".join(chars)
            assert parse_action(text) == reference_parse_action(text), text


@given(texts)
@settings(max_examples=1000, deadline=None)
def test_parse_action_equals_the_reference(text: str) -> None:
    assert parse_action(text) == reference_parse_action(text)


@given(texts)
@settings(max_examples=500, deadline=None)
def test_parse_action_reads_each_character_at_most_once(text: str) -> None:
    counted = CountingText(text)
    parse_action(counted)
    assert counted.reads <= len(text) + 2  # one read per character, two slices for the result


def brute_matching_open(text: str, close: int) -> int | None:
    """The ``[`` from which brackets first balance exactly at ``close``, by trying each one."""
    for start in range(close + 1):
        depth = 0
        for i in range(start, close + 1):
            depth += {"[": 1, "]": -1}.get(text[i], 0)
            if depth <= 0:
                break
        if text[start] == "[" and depth == 0 and i == close:
            return start
    return None


@given(texts, st.integers(-2, 45))
@settings(max_examples=300, deadline=None)
def test_find_matching_open_reads_back_from_close_once(text: str, close: int) -> None:
    close = min(close, len(text) - 1)
    counted = CountingText(text)
    assert find_matching_open(counted, close) == brute_matching_open(text, close)
    assert counted.reads <= max(0, close + 1)


@pytest.mark.parametrize("shape", list(MEGABYTE))
def test_megabyte_texts_are_read_right(shape: str) -> None:
    # Quadratic, the nested heads alone would take hours (36 KB took 55 s); linear, 0.2 s.
    text, expected = MEGABYTE[shape]
    assert parse_action(text) == expected


@pytest.mark.parametrize("shape", list(MEGABYTE))
def test_hostile_texts_are_read_in_one_pass(shape: str) -> None:
    text, expected = hostile(100_000)[shape]
    counted = CountingText(text)
    assert parse_action(counted) == expected
    assert counted.reads <= len(text) + 2


def test_a_long_turn_is_refused_naming_the_limit() -> None:
    assert refuse_long("x" * 10, 10) is None
    assert refuse_long("x" * 11, 10) == "error: action longer than 10 characters"
