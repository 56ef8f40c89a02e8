"""Every upstream attribute the GPU path calls, checked against the installed releases.

The project runs two sets of versions (the CPU lock and the GPU image's vLLM, torch and
transformers), and an attribute that one release has and the other lacks fails only where it
is called: on a GPU, minutes into a run. Each module that calls torch, transformers or vLLM on
that path keeps the list of what it calls beside the code (its ``UPSTREAM``); ``missing``
imports each name, so a test fails instead (``tests/vllm/test_upstream.py`` runs it where the
image's transformers range and vLLM are installed).

    missing()            # [] where every attribute resolves
"""

from __future__ import annotations

import importlib

MODULES = (
    "trace_core.policy.model",
    "trace_core.policy.update",
    "trace_core.policy.sharding",
    "trace_core.policy.vllm_engine",
    "trace_core.policy.vllm_worker",
)
"""The modules of the GPU path that keep an ``UPSTREAM`` list."""


def gpu_path_attributes() -> list[str]:
    """Every dotted name of every ``MODULES``' ``UPSTREAM``, in order, once."""
    names: list[str] = []
    for module in MODULES:
        for name in importlib.import_module(module).UPSTREAM:
            if name not in names:
                names.append(name)
    return names


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(f"no module of {dotted} imports")


def missing(names: list[str] | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """The names (default: ``gpu_path_attributes``) that do not resolve, each with why;
    ``skip``: top-level packages not installed here on purpose (vllm in the default venv)."""
    out = []
    for name in names if names is not None else gpu_path_attributes():
        if name.split(".")[0] in skip:
            continue
        try:
            resolve(name)
        except (ImportError, AttributeError) as err:
            out.append(f"{name}: {type(err).__name__}: {err}")
    return out
