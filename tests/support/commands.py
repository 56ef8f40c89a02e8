"""The commands of a Markdown file's ```bash blocks, as a reader would type them.

    commands("README.md text")    # ['make run', 'trace-rl task check calc', ...]

Continuation lines (a trailing backslash) are joined; shell comments (a ``#`` outside quotes,
at the start or after a blank) are dropped, and so are lines left empty.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def commands(text: str) -> list[str]:
    found: list[str] = []
    block: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            block = [] if line.strip() == "```bash" and block is None else None
            continue
        if block is None:
            continue
        body = without_comment(line).rstrip()
        if found and found[-1].endswith("\\"):
            found[-1] = found[-1][:-1].rstrip() + " " + body.strip()
        elif body.strip():
            found.append(body.strip())
    return found


def without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a shell comment (outside quotes, after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def run_in_docs_copy(command: str, repo: Path, where: Path) -> subprocess.CompletedProcess[str]:
    """``command`` as a reader types it, in ``where`` holding a copy of ``repo``'s docs/ (so
    what it writes leaves the repository alone), with this environment's ``trace-rl`` first on
    PATH; asserts it exits 0."""
    shutil.copytree(repo / "docs", where / "docs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        command, shell=True, cwd=where, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done


def run_tree_commands(summary: str, where: Path) -> subprocess.CompletedProcess[str]:
    """A run summary's commands that open its trees (``trace-rl inspect html``, then ``inspect
    query``), run as printed in ``where`` with this environment's scripts first on PATH; each
    must exit 0. Returns the query's result."""
    opening = commands(summary)
    assert [c.split()[1:3] for c in opening] == [["inspect", "html"], ["inspect", "query"]]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in opening:
        done = subprocess.run(
            command, shell=True, capture_output=True, text=True, cwd=where, env=env
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr[-2000:])
    return done
