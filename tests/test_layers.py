"""The layers import only downward and nothing imports in a circle (README.md, Layers; this
file is its enforcement):

    algo < envs, policy, store < rollout, retriever < train, bench < components < pipelines < cli

Every ``import`` of every module under trace_core/, components/ and pipelines/ is read with
``ast`` (module level, ``if TYPE_CHECKING:`` blocks and function bodies alike: a lazy import
is still a dependency), so a violation fails here whether or not a test happens to run it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trace_core", "components", "pipelines")
RANK = {
    "algo": 0,
    "envs": 1,
    "policy": 1,
    "store": 1,
    "rollout": 2,
    "retriever": 2,
    "train": 3,
    "bench": 3,
    "components": 4,
    "pipelines": 5,
    "cli": 6,
}
SIBLINGS_ALLOWED = {
    ("envs", "store"): "dataset files on S3 are read through the artifact store (envs.source)",
    ("bench", "train"): "the handoff bench runs iterations on resident trainers "
    "(train.trainer_group)",
}
"""Imports between layers of the same rank, each with its reason; any other is refused."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    del found["trace_core"]  # the empty top package: no layer of its own
    return found


MODULES = modules()


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "trace_core" and len(parts) > 1 else parts[0]


def owner(name: str) -> str | None:
    """The project module an imported name lives in (``a.b.c`` → ``a.b`` if c is a name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Project modules ``module`` imports anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {m for m in map(owner, names) if m and m != module}
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_the_whole_tree() -> None:
    assert {"trace_core.cli", "trace_core.train.contract", "pipelines.argo"} <= set(MODULES)
    assert {layer(m) for m in MODULES} <= set(RANK)
    assert "trace_core.train.contract" in GRAPH["trace_core.train.dispatch"]


def test_cycles_are_found() -> None:
    """The checker itself: a two-module and a three-module loop, and a chain that is none."""
    loops = cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}})
    assert sorted(loops) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_cycles() -> None:
    assert cycles(GRAPH) == []


def test_no_upward_or_sideways_imports() -> None:
    bad = []
    for module, targets in GRAPH.items():
        for target in targets:
            a, b = layer(module), layer(target)
            if a == b:
                continue
            if RANK[b] > RANK[a] or (RANK[b] == RANK[a] and (a, b) not in SIBLINGS_ALLOWED):
                bad.append(f"{module} ({a}) imports {target} ({b})")
    assert bad == []


def test_nothing_imports_the_command_line() -> None:
    users = sorted(m for m, targets in GRAPH.items() if layer(m) != "cli" and any(
        layer(t) == "cli" for t in targets
    ))  # fmt: skip
    assert users == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_near_the_old_command_line(module: str) -> None:
    """The command line was one 1,561-line module; no module comes near that now. One is over
    600 lines since the run's devices became one placement group (trainer_group): splitting it
    is part of issue 60's restructuring of train/; no other may pass 600."""
    limit = 640 if module in OVER_600 else 600
    assert len(MODULES[module].read_text().splitlines()) <= limit


OVER_600 = ("trace_core.train.trainer_group",)


# Runs in a fresh interpreter with a finder that refuses torch and transformers: the pipeline
# definitions, the components and the config they carry must not need them.
PROBE = """
import importlib, importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "vllm", "ray"):
            raise ImportError(f"{name} imported while loading the pipeline definitions")
        return None
sys.meta_path.insert(0, Refuse())
for module in sys.argv[1:]:
    importlib.import_module(module)
print("ok")
"""
LIGHT = (
    "trace_core.train.contract",
    "trace_core.train.config",
    "components",
    "pipelines.argo",
    "pipelines.trace_training",
    "pipelines.local",
)


def test_pipeline_definitions_import_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *LIGHT], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_the_probe_refuses_torch() -> None:
    """The probe above can fail: a module that needs torch is refused by it."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, "trace_core.policy.model"], capture_output=True, text=True
    )
    assert result.returncode != 0 and "torch imported" in result.stderr
