"""Headless Chromium for the tests that look at the HTML the project writes (the tree view, the
run's report).

Chromium is Debian's ``chromium`` package; ``make test`` installs it (``make browser``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def find_chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("no chromium on PATH: run `make browser` (apt-get install chromium)")
    return found


def headless(chromium: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: CI containers run as root; the page is ours and fetches nothing.
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={cwd / 'profile'}",
        *args,
    ]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
