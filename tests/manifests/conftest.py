"""Fixtures of the manifest checks: every overlay built once per session, the upstream schemas.

The builds come from ``render.py`` beside this file (also run by ``make scan``): a scratch copy
of manifests/ whose Secret env files are the tracked examples, built by ``kubectl kustomize``.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest
from support import render

SCHEMAS = render.REPO.parent / "shared" / "schemas"


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Overlay name (and "base") → the objects ``kubectl kustomize`` builds (``render.Builds``)."""
    return render.build_all(tmp_path_factory.mktemp("manifests"))


VENDORED = render.REPO / "tests" / "schemas"


@pytest.fixture(scope="session")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The upstream CRD schemas: shared/schemas beside the repository, or the gzipped copies
    in tests/schemas (same bytes; see its README)."""
    if (SCHEMAS / "kuberay").is_dir() and (SCHEMAS / "argo").is_dir():
        return SCHEMAS
    out = tmp_path_factory.mktemp("schemas")
    for packed in VENDORED.rglob("*.gz"):
        target = out / packed.relative_to(VENDORED).with_suffix("")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(gzip.decompress(packed.read_bytes()))
    return out
