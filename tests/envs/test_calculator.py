"""The calculator: worked values, every error it names, its bounds, and fuzzing.

The fuzzers check two things: arbitrary text only ever raises ``CalcError`` (and runs nothing),
and random expression trees evaluate to what a Fraction-arithmetic walk of the same tree gives.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trace_core.envs.calculator import MAX_MAGNITUDE, CalcError, evaluate


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12+7", 19),
        ("2+3*4", 14),  # * binds tighter than +
        ("(2+3)*4", 20),
        ("10-2-3", 5),  # left to right: (10-2)-3, not 10-(2-3)=11
        ("8/2/2", 2),  # (8/2)/2, not 8/(2/2)=8
        ("-3+5", 2),
        ("--3", 3),
        ("-(2+3)", -5),
        ("2*-3", -6),
        ("3--4", 7),  # 3 - (-4)
        ("-6/3", -2),
        (" 1 +\t2 ", 3),
        ("007", 7),
        ("0", 0),
    ],
)
def test_evaluate_worked_examples(expr: str, value: int) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("1/0", "division by zero"),
        ("5/(3-3)", "division by zero"),
        ("7/2", "7/2 is not a whole number"),
        ("", "empty expression"),
        ("   ", "empty expression"),
        ("1+", "expression ends early"),
        ("(1", r"expected '\)' at 3"),
        ("1)", r"unexpected '\)' at 2"),
        ("()", r"unexpected '\)' at 2"),
        ("1 2", "unexpected '2' at 3"),
        ("2**3", r"unexpected '\*' at 3"),
        ("+1", r"unexpected '\+' at 1"),  # only unary minus is in the grammar
        ("1.5", "unexpected character '.' at 2"),
        ("x", "unexpected character 'x' at 1"),
        ("１+1", "unexpected character"),  # a full-width digit is not a digit here
        ("2^3", "unexpected character '\\^'"),
    ],
)
def test_evaluate_names_the_error(expr: str, message: str) -> None:
    with pytest.raises(CalcError, match=message):
        evaluate(expr)


def test_calc_error_is_a_value_error() -> None:
    assert issubclass(CalcError, ValueError)


def test_length_bound_is_200_chars() -> None:
    at_limit = "1+" * 99 + "01"  # 200 chars, value 100
    assert len(at_limit) == 200
    assert evaluate(at_limit) == 100
    with pytest.raises(CalcError, match=r"expression too long \(201 chars, at most 200\)"):
        evaluate(at_limit + "0")


def test_literal_bound_is_12_digits() -> None:
    assert evaluate("9" * 12) == 999_999_999_999
    with pytest.raises(CalcError, match="at most 12 digits"):
        evaluate("1" + "0" * 12)


def test_magnitude_bound_is_10_to_the_15() -> None:
    # 999_999_999_999 * 1000 = 999_999_999_999_000 <= 10**15; one more thousand is over.
    assert evaluate("999999999999*1000") == 999_999_999_999_000
    assert evaluate("100000000000*10000") == MAX_MAGNITUDE  # exactly at the bound is allowed
    with pytest.raises(CalcError, match="number too large"):
        evaluate("999999999999*1001")
    with pytest.raises(CalcError, match="number too large"):
        evaluate("-999999999999*1001")
    with pytest.raises(CalcError, match="number too large"):
        evaluate("999999999999*1000+999999999999*1000")


def test_nesting_bound_is_20() -> None:
    assert evaluate("(" * 20 + "1" + ")" * 20) == 1
    with pytest.raises(CalcError, match=r"too deeply nested at 21 \(at most 20\)"):
        evaluate("(" * 21 + "1" + ")" * 21)


def test_long_runs_of_unary_minus_do_not_recurse() -> None:
    assert evaluate("-" * 199 + "1") == -1


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("(" * 500_000 + "1" + ")" * 500_000, "expression too long"),  # refused before reading
        ("-" * 1_000_000 + "1", "expression too long"),
        ("(" * 99 + "1" + ")" * 99, "too deeply nested at 21"),  # within 200 chars: depth bound
        ("(" * 199, "too deeply nested at 21"),
    ],
)
def test_deep_and_long_inputs_are_calc_errors_not_crashes(expr: str, message: str) -> None:
    with pytest.raises(CalcError, match=re.escape(message)):
        evaluate(expr)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('x')",
        "open('/etc/passwd').read()",
        "1+__import__('os').getpid()",
        "lambda: 1",
        "[1]*10**9",
        "9**9**9",
        "().__class__",
        "1;2",
    ],
)
def test_code_is_rejected_not_run(text: str) -> None:
    with pytest.raises(CalcError):
        evaluate(text)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=250))
def test_arbitrary_text_raises_only_calc_error(text: str) -> None:
    try:
        value = evaluate(text)
    except CalcError:
        return
    assert isinstance(value, int)
    assert abs(value) <= MAX_MAGNITUDE


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/() ", max_size=60))
def test_arithmetic_looking_text_raises_only_calc_error(text: str) -> None:
    with contextlib.suppress(CalcError):
        assert isinstance(evaluate(text), int)


# --- random expression trees against a Fraction reference --------------------------------------


@dataclass(frozen=True)
class Node:
    op: str  # "int", "neg", or one of + - * /
    value: int = 0
    left: Node | None = None
    right: Node | None = None


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def leaves() -> st.SearchStrategy[Node]:
    return st.integers(0, 99).map(lambda v: Node("int", v))


def extend(children: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
    binary = st.builds(
        lambda op, a, b: Node(op, left=a, right=b), st.sampled_from("+-*/"), children, children
    )
    return binary | children.map(lambda a: Node("neg", left=a))


trees = st.recursive(leaves(), extend, max_leaves=12)


def render(node: Node, redundant: bool) -> str:
    """Text with as few parentheses as the grammar needs (or around every operation)."""
    if node.op == "int":
        return str(node.value)
    assert node.left is not None
    if node.op == "neg":
        inner = render(node.left, redundant)
        return f"-({inner})" if node.left.op in _PRECEDENCE else f"-{inner}"
    assert node.right is not None
    left, right = render(node.left, redundant), render(node.right, redundant)
    precedence = _PRECEDENCE[node.op]
    if node.left.op in _PRECEDENCE and _PRECEDENCE[node.left.op] < precedence:
        left = f"({left})"
    # An equal-precedence right operand needs parentheses too: 1-(2-3) is not 1-2-3.
    if node.right.op in _PRECEDENCE and _PRECEDENCE[node.right.op] <= precedence:
        right = f"({right})"
    text = f"{left}{node.op}{right}"
    return f"({text})" if redundant else text


class Undefined(Exception):
    pass


def reference(node: Node) -> Fraction:
    """Exact value by walking the tree; Undefined where the calculator must refuse."""
    if node.op == "int":
        return Fraction(node.value)
    assert node.left is not None
    if node.op == "neg":
        return -reference(node.left)
    assert node.right is not None
    a, b = reference(node.left), reference(node.right)
    if node.op == "+":
        value = a + b
    elif node.op == "-":
        value = a - b
    elif node.op == "*":
        value = a * b
    else:
        if b == 0 or (a / b).denominator != 1:
            raise Undefined
        value = a / b
    if abs(value) > MAX_MAGNITUDE:
        raise Undefined
    return value


def nesting(text: str) -> int:
    depth = deepest = 0
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        deepest = max(deepest, depth)
    return deepest


@settings(max_examples=400, deadline=None)
@given(trees, st.booleans())
def test_expressions_agree_with_fraction_reference(tree: Node, redundant: bool) -> None:
    text = render(tree, redundant)
    assume(len(text) <= 200 and nesting(text) <= 20)
    try:
        expected: Fraction | None = reference(tree)
    except Undefined:
        expected = None
    if expected is None:
        with pytest.raises(CalcError):
            evaluate(text)
    else:
        assert expected.denominator == 1
        assert evaluate(text) == expected.numerator


def test_render_worked_example() -> None:
    # 1 - (2 - 3) keeps its parentheses; (1 * 2) + 3 loses them.
    one, two, three = Node("int", 1), Node("int", 2), Node("int", 3)
    tree = Node("-", left=one, right=Node("-", left=two, right=three))
    assert render(tree, redundant=False) == "1-(2-3)"
    assert evaluate(render(tree, redundant=False)) == 2
    tree = Node("+", left=Node("*", left=one, right=two), right=three)
    assert render(tree, redundant=False) == "1*2+3"
