"""The algo layer imports with numpy and the standard library only (README.md, Layers;
tests/test_layers.py checks every other layer)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import trace_core.algo

FORBIDDEN = ("torch", "ray", "kfp", "minio", "pyarrow", "vllm", "transformers", "pandas")

# Runs in a fresh interpreter: a finder that refuses the forbidden packages is installed
# first, so an import of any of them anywhere under trace_core.algo fails loudly.
PROBE = """
import importlib, importlib.abc, sys
FORBIDDEN = {forbidden!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"trace_core.algo must not import {{name}}")
        return None
sys.meta_path.insert(0, Refuse())
for module in {modules!r}:
    importlib.import_module(module)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(FORBIDDEN))
assert not loaded, loaded
print("ok", len({modules!r}))
"""


def test_algo_imports_without_heavy_libraries() -> None:
    modules = [
        m.name for m in pkgutil.walk_packages(trace_core.algo.__path__, prefix="trace_core.algo.")
    ]
    assert "trace_core.algo.allocate" in modules and "trace_core.algo.plan" in modules
    probe = PROBE.format(forbidden=FORBIDDEN, modules=modules)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
