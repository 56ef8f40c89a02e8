"""What the static check finds in the wheels' source: modules, classes, functions, values."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field


class NotFound(Exception):
    """A name does not resolve in the wheels; the message says where the lookup stopped."""


@dataclass
class SourceModule:
    """A module of the wheels: its parsed files (``.py``, then a ``.pyi`` beside it, or the
    ``.pyi`` of a compiled module) and what its module scope binds."""

    name: str
    package: bool
    scope: dict[str, list[tuple[object, ...]]] = field(default_factory=dict)
    typing_scope: dict[str, list[tuple[object, ...]]] = field(default_factory=dict)
    stars: list[str] = field(default_factory=list)
    typing_stars: list[str] = field(default_factory=list)
    all_names: set[str] | None = None
    all_dynamic: bool = False
    lazy_getattr: ast.FunctionDef | None = None
    replaces_itself: bool = False
    literals: dict[str, ast.expr] = field(default_factory=dict)
    annotations: dict[str, ast.expr] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceClass:
    node: ast.ClassDef
    module: SourceModule
    qualname: str

    def __str__(self) -> str:
        return f"{self.module.name}.{self.qualname}"


@dataclass(frozen=True)
class SourceFunction:
    nodes: tuple[ast.FunctionDef | ast.AsyncFunctionDef, ...]
    module: SourceModule
    owner: SourceClass | None
    qualname: str

    @property
    def method(self) -> bool:
        """Called on an instance or class: its first parameter is bound."""
        if self.owner is None:
            return False
        return not any(decorator_name(d) == "staticmethod" for d in self.nodes[0].decorator_list)


@dataclass(frozen=True)
class SourceInstance:
    klass: SourceClass


@dataclass(frozen=True)
class SourceValue:
    """A name that exists but whose value the source does not show (a call's result, ...)."""

    what: str
    literal: ast.expr | None = None
    module: SourceModule | None = None


@dataclass(frozen=True)
class External:
    """A name that comes from a package outside the wheels read."""

    dotted: str


Target = SourceModule | SourceClass | SourceFunction | SourceInstance | SourceValue | External


def decorator_name(node: ast.expr) -> str:
    while isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def literal_strings(node: ast.expr | None) -> list[str] | None:
    """The strings of a literal list/tuple/set of strings, else None."""
    if isinstance(node, ast.List | ast.Tuple | ast.Set) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


STAR_IMPORT = re.compile(r"^\s*from\s+(\.*)([\w.]*)\s+import\s+\*", re.MULTILINE)


def is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar", "Final[ClassVar"))


def no_init(value: ast.expr | None) -> bool:
    """A dataclass ``field(init=False)``."""
    return (
        isinstance(value, ast.Call)
        and decorator_name(value.func) == "field"
        and any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in value.keywords
        )
    )
