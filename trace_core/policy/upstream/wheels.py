"""The static check: entries resolved against the wheels' source, read as it is from the zip
files (``WheelSource``, ``unresolved``); nothing is imported or run."""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from trace_core.policy.upstream.entries import entries
from trace_core.policy.upstream.installed import self_assignment
from trace_core.policy.upstream.nodes import (
    STAR_IMPORT,
    External,
    NotFound,
    SourceClass,
    SourceFunction,
    SourceInstance,
    SourceModule,
    SourceValue,
    Target,
    is_classvar,
    is_type_checking,
    literal_strings,
)
from trace_core.policy.upstream.signatures import Parameters


class WheelSource(Parameters):
    """The Python source of a set of wheels, read from the zip files as they are.

    ``resolve`` and ``check`` take entries; nothing is imported or executed. A module is
    ``a/b/c.py`` or ``a/b/c/__init__.py``, with a ``.pyi`` beside it read as well (a compiled
    module has only its ``.pyi``: ``torch._C._distributed_c10d``)."""

    def __init__(self, wheels: Iterable[Path | str]) -> None:
        self._files: dict[str, list[tuple[zipfile.ZipFile, str, bool]]] = {}
        self.releases: dict[str, str] = {}
        """Top-level package → "dist version" of the wheel it came from."""
        self._modules: dict[str, SourceModule | None] = {}
        self._texts: dict[str, tuple[str, list[str]]] = {}
        for wheel in wheels:
            archive = zipfile.ZipFile(wheel)
            dist, version = Path(wheel).name.split("-")[:2]
            for member in archive.namelist():
                if not member.endswith((".py", ".pyi")) or ".dist-info/" in member:
                    continue
                stem = member.rpartition(".")[0]
                parts = stem.split("/")
                package = parts[-1] == "__init__"
                if package:
                    parts = parts[:-1]
                if not parts or not all(p.isidentifier() for p in parts):
                    continue
                module = ".".join(parts)
                self._files.setdefault(module, []).append((archive, member, package))
                self.releases.setdefault(parts[0], f"{dist} {version}")
        for files in self._files.values():
            files.sort(key=lambda f: f[1].endswith(".pyi"))  # .py first

    def close(self) -> None:
        """Close the wheels' zip files."""
        for archive in {id(a): a for files in self._files.values() for a, _, _ in files}.values():
            archive.close()

    def __enter__(self) -> WheelSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has_module(self, name: str) -> bool:
        return name in self._files

    def release(self, dotted: str) -> str:
        return self.releases.get(dotted.split(".")[0], dotted.split(".")[0])

    # -- modules ---------------------------------------------------------------------------
    def module(self, name: str) -> SourceModule | None:
        if name not in self._modules:
            self._modules[name] = self._load(name) if name in self._files else None
        return self._modules[name]

    def _load(self, name: str) -> SourceModule:
        files = self._files[name]
        module = SourceModule(name=name, package=any(p for _, _, p in files))
        for archive, member, _ in files:
            source = archive.read(member).decode("utf-8", "replace")
            try:
                tree = ast.parse(source, filename=member)
            except SyntaxError:
                continue
            self._bind(module, tree.body, typing=False, stub=member.endswith(".pyi"))
        return module

    def _mentions(self, name: str, word: str, seen: set[str]) -> bool:
        """Whether module ``name``'s text, or that of a module it star-imports, has ``word``
        (read as text, before anything is parsed)."""
        if name in seen or name not in self._files:
            return False
        seen.add(name)
        if name not in self._texts:
            text = "\n".join(
                archive.read(member).decode("utf-8", "replace")
                for archive, member, _ in self._files[name]
            )
            here = SourceModule(name, any(p for _, _, p in self._files[name]))
            stars = [self._absolute(here, len(d), t or None) for d, t in STAR_IMPORT.findall(text)]
            self._texts[name] = (text, stars)
        text, stars = self._texts[name]
        if word in text and re.search(rf"\b{re.escape(word)}\b", text):
            return True
        return any(self._mentions(star, word, seen) for star in stars)

    def _absolute(self, module: SourceModule, level: int, target: str | None) -> str:
        if level == 0:
            return target or ""
        base = module.name.split(".")
        if not module.package:
            base = base[:-1]
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join(base + ([target] if target else []))

    def _bind(self, module: SourceModule, body: list[ast.stmt], typing: bool, stub: bool) -> None:
        scope = module.typing_scope if typing else module.scope
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                scope.setdefault(node.name, []).append(("node", node))
                if node.name == "__getattr__" and not typing and not isinstance(node, ast.ClassDef):
                    module.lazy_getattr = node  # type: ignore[assignment]
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind_target(module, scope, target, node.value, None, typing)
                    if (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Attribute)
                        and target.value.attr == "modules"
                        and isinstance(target.slice, ast.Name)
                        and target.slice.id == "__name__"
                    ):
                        module.replaces_itself = True
            elif isinstance(node, ast.AnnAssign):
                if isinstance(node.target, ast.Name):
                    module.annotations[node.target.id] = node.annotation
                    if node.value is not None or stub:
                        self._bind_target(
                            module, scope, node.target, node.value, node.annotation, typing
                        )
            elif isinstance(node, ast.AugAssign):
                if isinstance(node.target, ast.Name) and node.target.id == "__all__":
                    self._add_all(module, node.value)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                call = node.value
                if (
                    isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == "__all__"
                    and call.args
                ):
                    if call.func.attr == "append":
                        self._add_all(module, ast.List(elts=[call.args[0]]))
                    elif call.func.attr == "extend":
                        self._add_all(module, call.args[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        scope.setdefault(alias.asname, []).append(("module", alias.name))
                    else:
                        top = alias.name.split(".")[0]
                        scope.setdefault(top, []).append(("module", top))
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node.level, node.module)
                for alias in node.names:
                    if alias.name == "*":
                        (module.typing_stars if typing else module.stars).append(source)
                    else:
                        scope.setdefault(alias.asname or alias.name, []).append(
                            ("from", source, alias.name)
                        )
            elif isinstance(node, ast.If):
                if is_type_checking(node.test):
                    self._bind(module, node.body, True, stub)
                    self._bind(module, node.orelse, typing, stub)
                else:
                    self._bind(module, node.body, typing, stub)
                    self._bind(module, node.orelse, typing, stub)
            elif isinstance(node, ast.Try):
                self._bind(module, node.body, typing, stub)
                for handler in node.handlers:
                    self._bind(module, handler.body, typing, stub)
                self._bind(module, node.orelse, typing, stub)
                self._bind(module, node.finalbody, typing, stub)
            elif isinstance(node, ast.With):
                self._bind(module, node.body, typing, stub)

    def _bind_target(
        self,
        module: SourceModule,
        scope: dict[str, list[tuple[object, ...]]],
        target: ast.expr,
        value: ast.expr | None,
        annotation: ast.expr | None,
        typing: bool,
    ) -> None:
        if isinstance(target, ast.Name):
            if target.id == "__all__" and not typing:
                module.all_names = set()
                module.all_dynamic = False
                self._add_all(module, value)
                return
            scope.setdefault(target.id, []).append(("value", value, annotation))
            if isinstance(value, ast.Dict | ast.Set | ast.List | ast.Tuple | ast.Call):
                module.literals[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._bind_target(module, scope, element, None, None, typing)

    def _add_all(self, module: SourceModule, value: ast.expr | None) -> None:
        names = literal_strings(value)
        if names is None:
            if isinstance(value, ast.BinOp):  # __all__ = a + [...]
                self._add_all(module, value.left)
                self._add_all(module, value.right)
                return
            module.all_dynamic = True
            return
        if module.all_names is None:
            module.all_names = set()
        module.all_names.update(names)

    # -- names -----------------------------------------------------------------------------
    def resolve(self, dotted: str) -> Target:
        """What ``dotted`` names in the wheels; NotFound with where it stopped."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = self.module(".".join(parts[:cut]))
            if module is None:
                continue
            target: Target = module
            for attribute in parts[cut:]:
                target = self.attribute(target, attribute)
            return target
        raise NotFound(f"no module {parts[0]} in the wheels read")

    def attribute(self, target: Target, name: str) -> Target:
        """``target.name``; NotFound saying what lacks it."""
        if isinstance(target, SourceModule):
            found = self._module_attribute(target, name, set())
            if found is None:
                raise NotFound(f"module {target.name} has no attribute {name}")
            return found
        if isinstance(target, SourceClass | SourceInstance):
            klass = target if isinstance(target, SourceClass) else target.klass
            unfollowed: list[str] = []
            found = self._class_attribute(klass, name, unfollowed)
            if found is None:
                also = f" (bases not read: {', '.join(unfollowed)})" if unfollowed else ""
                raise NotFound(
                    f"{klass.qualname} ({klass.module.name}) has no attribute {name}{also}"
                )
            return found
        if isinstance(target, External):
            raise NotFound(f"{target.dotted} comes from outside the wheels read: .{name} unchecked")
        if isinstance(target, SourceFunction):
            raise NotFound(f"{target.qualname} is a function: no attribute {name} to read")
        raise NotFound(f"{target.what}: its attributes cannot be read from the source ({name})")

    def _module_attribute(
        self, module: SourceModule, name: str, seen: set[tuple[str, str]]
    ) -> Target | None:
        key = (module.name, name)
        if key in seen:
            return None
        seen = seen | {key}
        if name in module.scope:
            return self._binding(module, module.scope[name], name, seen)
        submodule = f"{module.name}.{name}"
        if module.package and self.has_module(submodule):
            return self.module(submodule)
        for star in module.stars:
            found = self._star(star, name, seen)
            if found is not None:
                return found
        if module.lazy_getattr is not None:
            found = self._lazy(module, name, seen)
            if found is not None:
                return found
        if module.replaces_itself:  # a _LazyModule: its TYPE_CHECKING imports say what it has
            if name in module.typing_scope:
                return self._binding(module, module.typing_scope[name], name, seen)
            for star in module.typing_stars:
                found = self._star(star, name, seen)
                if found is not None:
                    return found
        return None

    def _star(self, source: str, name: str, seen: set[tuple[str, str]]) -> Target | None:
        if not self._mentions(source, name, set()):
            return None  # not parsed: a star import's chain can reach hundreds of modules
        star = self.module(source)
        if star is None:
            return None
        exported = star.all_names if not star.all_dynamic else None
        if exported is not None and name not in exported:
            return None
        if exported is None and name.startswith("_"):
            return None
        return self._module_attribute(star, name, seen)

    def _lazy(self, module: SourceModule, name: str, seen: set[tuple[str, str]]) -> Target | None:
        """A name a module's ``__getattr__`` provides, where its body says which."""
        function = module.lazy_getattr
        assert function is not None
        if not function.args.args:
            return None
        param = function.args.args[0].arg
        for node in ast.walk(function):
            if not (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Name)
                and node.left.id == param
                and len(node.ops) == 1
            ):
                continue
            op, right = node.ops[0], node.comparators[0]
            if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and right.value == name:
                return self._lazy_value(module, name, seen)
            if not isinstance(op, ast.In):
                continue
            names = literal_strings(right)
            if isinstance(right, ast.Name) and right.id in module.literals:
                literal = module.literals[right.id]
                if isinstance(literal, ast.Call) and literal.args:  # frozenset({...})
                    literal = literal.args[0]
                if isinstance(literal, ast.Dict):
                    for key, value in zip(literal.keys, literal.values, strict=True):
                        if isinstance(key, ast.Constant) and key.value == name:
                            return self._mapped(module, name, value, seen)
                    continue
                names = literal_strings(literal)
            if names is not None and name in names:
                return self._lazy_value(module, name, seen)
        return None

    def _mapped(
        self, module: SourceModule, name: str, value: ast.expr | None, seen: set[tuple[str, str]]
    ) -> Target:
        """The target of a lazy mapping's ``"module:attr"`` (or ``(module, attr)``) value."""
        where: list[str] | None = None
        if isinstance(value, ast.Constant) and isinstance(value.value, str) and ":" in value.value:
            where = value.value.split(":", 1)
        elif literal_strings(value) is not None and len(literal_strings(value) or []) == 2:
            where = literal_strings(value)
        if where is None:
            return SourceValue(f"{module.name}.{name} (lazy)", module=module)
        path, attribute = where
        level = len(path) - len(path.lstrip("."))
        absolute = self._absolute(SourceModule(module.name, True), level, path.lstrip(".") or None)
        source = self.module(absolute)
        if source is None:
            raise NotFound(f"{module.name}.{name} maps to {path}:{attribute}; no module {absolute}")
        found = self._module_attribute(source, attribute, seen)
        if found is None:
            raise NotFound(f"{module.name}.{name} maps to {absolute}:{attribute}, which it lacks")
        return found

    def _lazy_value(self, module: SourceModule, name: str, seen: set[tuple[str, str]]) -> Target:
        submodule = f"{module.name}.{name}"
        if module.package and self.has_module(submodule):
            module_target = self.module(submodule)
            assert module_target is not None
            return module_target
        annotation = module.annotations.get(name)
        if annotation is not None:
            typed = self._instance_of(module, annotation)
            if typed is not None:
                return typed
        return SourceValue(f"{module.name}.{name} (from its module __getattr__)")

    def _binding(
        self,
        module: SourceModule,
        bindings: list[tuple[object, ...]],
        name: str,
        seen: set[tuple[str, str]],
    ) -> Target:
        """The most telling of a name's bindings: the last one, skipping values the source does
        not show (``X = wrap(X)``, ``X = None`` after a failed import) when another exists."""
        fallback: Target | None = None
        error: NotFound | None = None
        for binding in reversed(bindings):
            try:
                target = self._one_binding(module, binding, name, seen)
            except NotFound as err:  # another binding (a try/except import) may hold
                error = error or err
                continue
            if target is None:
                continue
            if isinstance(target, SourceValue):
                fallback = fallback or target
                continue
            if isinstance(target, SourceFunction) and target.nodes[0].name == name:
                overloads = tuple(
                    b[1]
                    for b in bindings
                    if b[0] == "node" and isinstance(b[1], ast.FunctionDef | ast.AsyncFunctionDef)
                )
                return SourceFunction(overloads or target.nodes, module, None, name)
            return target
        if fallback is None:
            raise error or NotFound(f"{module.name}.{name} is bound to nothing the source shows")
        return fallback

    def _one_binding(
        self,
        module: SourceModule,
        binding: tuple[object, ...],
        name: str,
        seen: set[tuple[str, str]],
    ) -> Target | None:
        kind = binding[0]
        if kind == "node":
            node = binding[1]
            if isinstance(node, ast.ClassDef):
                return SourceClass(node, module, node.name)
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            return SourceFunction((node,), module, None, node.name)
        if kind == "module":
            target = self.module(str(binding[1]))
            return target if target is not None else External(str(binding[1]))
        if kind == "from":
            source, attribute = str(binding[1]), str(binding[2])
            origin = self.module(source)
            if origin is None:
                if source.split(".")[0] in self.releases:
                    raise NotFound(
                        f"{module.name} imports {attribute} from {source}: no such module"
                    )
                return External(f"{source}.{attribute}")
            found = self._module_attribute(origin, attribute, seen)
            if found is None:
                if self.has_module(f"{source}.{attribute}"):
                    return self.module(f"{source}.{attribute}")
                raise NotFound(f"{module.name} imports {attribute} from {source}, which lacks it")
            return found
        value, annotation = binding[1], binding[2]
        assert value is None or isinstance(value, ast.expr)
        if isinstance(value, ast.Constant) and value.value is None:
            return SourceValue(f"{module.name}.{name} (None)")
        if value is not None and not (
            isinstance(value, ast.Call)
            and any(isinstance(a, ast.Name) and a.id == name for a in value.args)
        ):
            evaluated = self._evaluate(module, value, seen, name)
            if evaluated is not None:
                return evaluated
        if isinstance(annotation, ast.expr):
            typed = self._instance_of(module, annotation)
            if typed is not None:
                return typed
        return SourceValue(f"{module.name}.{name}", value, module)

    def _evaluate(
        self, module: SourceModule, node: ast.expr, seen: set[tuple[str, str]], avoid: str = ""
    ) -> Target | None:
        """What an expression in ``module``'s scope is (a name, attributes of it, a call of a
        class); None where the source does not say."""
        try:
            if isinstance(node, ast.Name):
                if node.id == avoid:
                    return None
                return self._module_attribute(module, node.id, seen)
            if isinstance(node, ast.Attribute):
                base = self._evaluate(module, node.value, seen, avoid)
                return None if base is None else self.attribute(base, node.attr)
            if isinstance(node, ast.Subscript):
                return self._evaluate(module, node.value, seen, avoid)
            if isinstance(node, ast.Call):
                called = self._evaluate(module, node.func, seen, avoid)
                return SourceInstance(called) if isinstance(called, SourceClass) else None
        except NotFound:
            return None
        return None

    def _instance_of(self, module: SourceModule, annotation: ast.expr) -> SourceInstance | None:
        """An instance of the class an annotation names (``X``, ``X | None``, ``"X"``)."""
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            sides = [annotation.left, annotation.right]
            sides = [s for s in sides if not (isinstance(s, ast.Constant) and s.value is None)]
            return self._instance_of(module, sides[0]) if len(sides) == 1 else None
        target = self._evaluate(module, annotation, set())
        return SourceInstance(target) if isinstance(target, SourceClass) else None

    # -- classes ---------------------------------------------------------------------------
    def _class_body(self, klass: SourceClass) -> Iterator[ast.stmt]:
        """The statements of a class body, into its ``if``/``try`` blocks."""
        work = list(klass.node.body)
        while work:
            node = work.pop(0)
            if isinstance(node, ast.If):
                work = node.body + node.orelse + work
            elif isinstance(node, ast.Try):
                work = node.body + [s for h in node.handlers for s in h.body] + node.orelse + work
            else:
                yield node

    def _own_attribute(self, klass: SourceClass, name: str) -> Target | None:
        defs = []
        found: Target | None = None
        for node in self._class_body(klass):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                defs.append(node)
            elif isinstance(node, ast.ClassDef) and node.name == name:
                found = SourceClass(node, klass.module, f"{klass.qualname}.{name}")
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                found = found or self._class_value(klass, name, node.value, None)
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                found = found or self._class_value(klass, name, node.value, node.annotation)
        if defs:
            return SourceFunction(tuple(defs), klass.module, klass, f"{klass.qualname}.{name}")
        if found is not None:
            return found
        for method in self._class_body(klass):
            if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                assigned, annotation = self_assignment(method, name)
                if assigned:
                    typed = self._instance_of(klass.module, annotation) if annotation else None
                    return typed or SourceValue(f"{klass}.{name} (set in {method.name})")
        return None

    def _class_value(
        self, klass: SourceClass, name: str, value: ast.expr | None, annotation: ast.expr | None
    ) -> Target:
        if annotation is not None and not is_classvar(annotation):
            typed = self._instance_of(klass.module, annotation)
            if typed is not None:
                return typed
        return SourceValue(f"{klass}.{name}", value, klass.module)

    def bases(self, klass: SourceClass, unfollowed: list[str]) -> list[SourceClass]:
        """The classes ``klass``'s bases evaluate to in its module (the others in
        ``unfollowed``)."""
        out = []
        for base in klass.node.bases:
            target = self._evaluate(klass.module, base, set())
            if isinstance(target, SourceClass):
                out.append(target)
            elif not (isinstance(base, ast.Name) and base.id == "object"):
                unfollowed.append(ast.unparse(base))
        return out

    def mro(self, klass: SourceClass, unfollowed: list[str]) -> list[SourceClass]:
        """``klass`` and its bases, depth first, left to right, once each."""
        out: list[SourceClass] = []
        work = [klass]
        while work:
            current = work.pop(0)
            if any(c.node is current.node for c in out):
                continue
            out.append(current)
            work = self.bases(current, unfollowed) + work
        return out

    def _class_attribute(
        self, klass: SourceClass, name: str, unfollowed: list[str]
    ) -> Target | None:
        for current in self.mro(klass, unfollowed):
            found = self._own_attribute(current, name)
            if found is not None:
                return found
        return None


def unresolved(
    wheels: Iterable[Path | str] | WheelSource, names: Iterable[str] | None = None
) -> list[str]:
    """The entries (default: ``gpu_path_attributes``, those for ``cuda``) that do not hold in
    ``wheels`` (the GPU image's), each as one line saying why."""
    if not isinstance(wheels, WheelSource):
        with WheelSource(wheels) as source:
            return unresolved(source, names)
    return [problem for entry in entries(names, "cuda") if (problem := wheels.check(entry))]
