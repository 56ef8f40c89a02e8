"""The static check's parameters: whether a callable in the wheels takes what an entry passes."""

from __future__ import annotations

import ast

from trace_core.policy.upstream.entries import Entry
from trace_core.policy.upstream.installed import kwargs_use
from trace_core.policy.upstream.nodes import (
    External,
    NotFound,
    SourceClass,
    SourceFunction,
    SourceValue,
    Target,
    is_classvar,
    literal_strings,
    no_init,
)


class Parameters:
    """``WheelSource``'s parameter checks (it provides ``resolve``, ``mro`` and the rest)."""

    # -- parameters ------------------------------------------------------------------------
    def parameters(self, entry: Entry, target: Target) -> str:
        """Why ``target`` does not take ``entry``'s parameters; empty if it does."""
        if isinstance(target, SourceValue) and (
            isinstance(target.literal, ast.Dict) or literal_strings(target.literal) is not None
        ):
            keys = self._dict_keys(target)
            extra = [k for k in entry.keywords if k not in keys]
            if entry.positional:
                return f"{target.what} is a table of names: nothing is passed by position"
            return f"{target.what} does not name {', '.join(map(repr, extra))}" if extra else ""
        if isinstance(target, SourceClass):
            signatures = self._class_signatures(target)
            if isinstance(signatures, str):
                return signatures
        elif isinstance(target, SourceFunction):
            signatures = [(n, target) for n in target.nodes]
        else:
            what = (
                target.dotted if isinstance(target, External) else getattr(target, "what", target)
            )
            return f"{what}: not a function or class whose parameters the source shows"
        problems = []
        for signature, owner in signatures:
            problem = self._signature_problem(entry, signature, owner)
            if not problem:
                return ""
            problems.append(problem)
        return problems[-1]

    def _dict_keys(self, value: SourceValue) -> set[str]:
        """The names a table holds: a dict's string keys (``**`` spreads of module-level
        dicts included), or a list's strings."""
        keys: set[str] = set()
        literal = value.literal
        if not isinstance(literal, ast.Dict):
            return set(literal_strings(literal) or [])
        for key, item in zip(literal.keys, literal.values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
            elif key is None and isinstance(item, ast.Name) and value.module is not None:
                spread = value.module.literals.get(item.id)
                if isinstance(spread, ast.Dict):
                    keys |= self._dict_keys(SourceValue(item.id, spread, value.module))
        return keys

    def _class_signatures(
        self, klass: SourceClass
    ) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef | list[str], object]] | str:
        """The ``__init__`` overloads of ``klass`` (through its bases), or its fields."""
        unfollowed: list[str] = []
        mro = self.mro(klass, unfollowed)
        for current in mro:
            init = [
                n
                for n in self._class_body(current)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == "__init__"
            ]
            if init:
                function = SourceFunction(
                    tuple(init), current.module, current, f"{current.qualname}.__init__"
                )
                return [(n, function) for n in init]
        fields: list[str] = []
        for current in reversed(mro):
            for node in self._class_body(current):
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name)
                    and not is_classvar(node.annotation)
                    and not no_init(node.value)
                    and ast.unparse(node.annotation) != "KW_ONLY"
                ):
                    fields = [f for f in fields if f != node.target.id] + [node.target.id]
        if not fields:
            also = f"; bases not read: {', '.join(unfollowed)}" if unfollowed else ""
            return f"{klass.qualname} ({klass.module.name}) shows no __init__ and no fields{also}"
        return [(fields, klass)]

    def _signature_problem(self, entry: Entry, signature: object, owner: object) -> str:
        if isinstance(signature, list):  # fields
            positional, keywords, kwarg = signature, set(signature), None
            function = None
            label = f"{owner}"
        else:
            assert isinstance(signature, ast.FunctionDef | ast.AsyncFunctionDef)
            assert isinstance(owner, SourceFunction)
            function = signature
            args = signature.args
            positional = [a.arg for a in args.posonlyargs + args.args]
            if owner.method and positional:
                positional = positional[1:]
            keywords = {a.arg for a in args.args + args.kwonlyargs}
            if owner.method and args.args and not args.posonlyargs:
                keywords.discard(args.args[0].arg)
            kwarg = args.kwarg.arg if args.kwarg else None
            label = f"{owner.module.name}.{owner.qualname.removesuffix('.__init__')}"
        if list(entry.positional) != positional[: len(entry.positional)]:
            return (
                f"{label}() takes ({', '.join(positional[: max(len(entry.positional), 1) + 2])}"
                f"{', ...' if len(positional) > len(entry.positional) + 2 else ''}) by position, "
                f"not ({', '.join(entry.positional)})"
            )
        bad = [k for k in entry.keywords if k not in keywords]
        if bad and kwarg is not None and function is not None:
            assert isinstance(owner, SourceFunction)
            bad = [k for k in bad if not self._kwargs_accept(owner, function, kwarg, k)]
        if bad:
            note = f" (its **{kwarg} does not read it)" if kwarg else ""
            return f"{label}() takes no parameter {', '.join(map(repr, bad))}{note}"
        return ""

    def _kwargs_accept(
        self,
        owner: SourceFunction,
        function: ast.FunctionDef | ast.AsyncFunctionDef,
        kwarg: str,
        keyword: str,
    ) -> bool:
        reads, forwards = kwargs_use(function, kwarg)
        if keyword in reads:
            return True
        if not forwards or owner.owner is None:
            return False
        unfollowed: list[str] = []
        mro = self.mro(owner.owner, unfollowed)
        for base in mro[1:]:
            found = self._own_attribute(base, function.name)
            if isinstance(found, SourceFunction):
                entry = Entry(text="", name="", keywords=(keyword,), parameters=True)
                return any(not self._signature_problem(entry, n, found) for n in found.nodes)
        return False

    # -- the check -------------------------------------------------------------------------
    def check(self, entry: Entry) -> str:
        """Why ``entry`` does not hold in these wheels (one line); empty if it does."""
        release = self.release(entry.name)
        try:
            target = self.resolve(entry.name)
        except NotFound as err:
            return f"{entry.text}: {release}: {err}"
        if isinstance(target, External):
            return f"{entry.text}: {release}: it is {target.dotted}, outside the wheels read"
        if entry.parameters:
            problem = self.parameters(entry, target)
            if problem:
                return f"{entry.text}: {release}: {problem}"
        return ""
