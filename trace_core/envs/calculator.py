"""Safe integer arithmetic for the ``calc[...]`` tool: a tokenizer and a recursive-descent parser.

    evaluate("12+7")         -> 19
    evaluate("-(3+4)*2")     -> -14
    evaluate("7/2")          -> CalcError("7/2 is not a whole number")

The agent's text is untrusted, so nothing here hands it to ``eval``/``exec``/``compile`` or the
``ast`` module: the grammar below is the whole language, and anything outside it is a
``CalcError`` (a ``ValueError``). No other exception escapes ``evaluate``.

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/") unary)*
    unary  := "-"* atom
    atom   := INTEGER | "(" expr ")"

Division is exact: ``a / b`` is an error unless b divides a. The word problems of ``calc`` only
ever divide evenly, so a remainder means the agent copied a wrong number, and saying so is more
useful to it than silently flooring. Every bound below keeps a call cheap (the parser recurses
once per parenthesis, and big integers make Python arithmetic slow).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHARS = 200
MAX_DIGITS = 12
MAX_MAGNITUDE = 10**15
MAX_DEPTH = 20

_DIGITS = frozenset("0123456789")
_SYMBOLS = frozenset("+-*/()")
_SPACES = frozenset(" \t")


class CalcError(ValueError):
    """The expression is malformed, out of bounds or undefined; the message says which."""


@dataclass(frozen=True)
class _Token:
    kind: str  # "int", one of the symbols, or "end"
    text: str
    position: int  # 1-based, as a person counts characters


def tokenize(expr: str) -> list[_Token]:
    """Integers and the six symbols; spaces and tabs between them are skipped."""
    if len(expr) > MAX_CHARS:
        raise CalcError(f"expression too long ({len(expr)} chars, at most {MAX_CHARS})")
    tokens: list[_Token] = []
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in _SPACES:
            i += 1
        elif char in _SYMBOLS:
            tokens.append(_Token(char, char, i + 1))
            i += 1
        elif char in _DIGITS:
            start = i
            while i < len(expr) and expr[i] in _DIGITS:
                i += 1
            if i - start > MAX_DIGITS:
                raise CalcError(f"number too long at {start + 1} (at most {MAX_DIGITS} digits)")
            tokens.append(_Token("int", expr[start:i], start + 1))
        else:
            raise CalcError(f"unexpected character {char!r} at {i + 1}")
    tokens.append(_Token("end", "", len(expr) + 1))
    return tokens


class _Parser:
    """Recursive descent over the token list; each method returns the value of what it read."""

    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.index = 0
        self.depth = 0

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def take(self) -> _Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def expr(self) -> int:
        value = self.term()
        while self.peek().kind in ("+", "-"):
            op = self.take().kind
            right = self.term()
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def term(self) -> int:
        value = self.unary()
        while self.peek().kind in ("*", "/"):
            op = self.take().kind
            right = self.unary()
            value = _bounded(value * right) if op == "*" else _divide(value, right)
        return value

    def unary(self) -> int:
        # A loop, not recursion: "------1" must not cost a stack frame per sign.
        negate = False
        while self.peek().kind == "-":
            self.take()
            negate = not negate
        value = self.atom()
        return -value if negate else value

    def atom(self) -> int:
        token = self.take()
        if token.kind == "int":
            return int(token.text)
        if token.kind == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CalcError(f"too deeply nested at {token.position} (at most {MAX_DEPTH})")
            value = self.expr()
            closing = self.take()
            if closing.kind != ")":
                raise CalcError(f"expected ')' at {closing.position}")
            self.depth -= 1
            return value
        if token.kind == "end":
            raise CalcError("expression ends early")
        raise CalcError(f"unexpected {token.text!r} at {token.position}")


def _bounded(value: int) -> int:
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("number too large (at most 10^15 in size)")
    return value


def _divide(a: int, b: int) -> int:
    if b == 0:
        raise CalcError("division by zero")
    if a % b != 0:
        raise CalcError(f"{a}/{b} is not a whole number")
    return a // b


def evaluate(expr: str) -> int:
    """The integer value of ``expr``; ``CalcError`` for anything malformed or out of bounds."""
    if not isinstance(expr, str):
        raise CalcError(f"expression must be text, got {type(expr).__name__}")
    tokens = tokenize(expr)
    if len(tokens) == 1:
        raise CalcError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    trailing = parser.peek()
    if trailing.kind != "end":
        raise CalcError(f"unexpected {trailing.text!r} at {trailing.position}")
    return value
