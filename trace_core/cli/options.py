"""Command-line options declared once: a config dataclass's fields become a command's flags,
with the field's docstring as the help text and its default as the flag's.

    @app.command("train")
    @config_options(TrainConfig, skip={"output"})
    def train_command(config: TrainConfig, threads: int = 0) -> None:
        ...                                   # --task, --budget, --lr, --workers, ... built here

Nested configs (``TrainConfig.update``, ``TrainConfig.engine``) are flattened: their fields are
flags of the same command (``--lr``, ``--workers``). The command receives the config built
from the flags; a value the config refuses is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, TypeVar

import typer

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., None])


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (the attribute-docstring convention)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _leaves(cls: type, skip: Collection[str]) -> list[tuple[str | None, dataclasses.Field[Any]]]:
    """(nested field or None, field) for every flag of ``cls``, in declaration order."""
    out: list[tuple[str | None, dataclasses.Field[Any]]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(hints[f.name]):  # a nested config: its fields are flags
            kind = hints[f.name]
            out += [(f.name, g) for g in dataclasses.fields(kind) if g.name not in skip]
        else:
            out.append((None, f))
    return out


def config_options(
    cls: type[C],
    skip: Collection[str] = (),
    defaults: Mapping[str, object] | None = None,
    types: Mapping[str, object] | None = None,
) -> Callable[[F], F]:
    """Give the decorated command one flag per field of ``cls`` and call it with ``config``.

    ``skip``: fields that are not flags (their defaults are used); ``defaults``: a flag's
    default where the command's differs from the config's; ``types``: a flag's type where the
    field's is not one typer parses (``Path | str | None``)."""
    hints = typing.get_type_hints(cls)
    base = cls()  # every flag's default is the default config's value
    leaves = _leaves(cls, skip)
    names = [f.name for _, f in leaves]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise TypeError(f"{cls.__name__}: flags {clash} would be declared twice")

    def decorate(command: F) -> F:
        # The command's first parameter receives the config; the rest are its own flags.
        _, *own = inspect.signature(command).parameters.values()
        params = []
        for parent, f in leaves:
            owner = hints[parent] if parent else cls
            kind = (types or {}).get(f.name, typing.get_type_hints(owner)[f.name])
            value = getattr(getattr(base, parent), f.name) if parent else getattr(base, f.name)
            default = (defaults or {}).get(f.name, value)
            help_text = field_docs(owner).get(f.name, "")
            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=default,
                    annotation=Annotated[kind, typer.Option(help=help_text)],
                )
            )

        @functools.wraps(command)
        def run(**values: Any) -> None:
            config: dict[str, Any] = {}
            nested: dict[str, dict[str, Any]] = {}
            for parent, f in leaves:
                target = nested.setdefault(parent, {}) if parent else config
                target[f.name] = values.pop(f.name)
            for parent, fields in nested.items():
                config[parent] = hints[parent](**fields)
            built = cls(**config)
            command(built, **values)

        hints_of_command = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints_of_command.get(p.name, p.annotation)) for p in own]
        run.__signature__ = inspect.Signature([*own, *params])  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in [*own, *params]}
        del run.__wrapped__  # typer must read the signature above, not the command's
        return run  # type: ignore[return-value]

    return decorate
