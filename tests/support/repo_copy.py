"""A copy of the repository to run `make` targets and printed commands in, without touching the
checkout the tests run from.

    repo = repository_copy(tmp_path / "repo")    # then: subprocess.run(["make", ...], cwd=repo)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def repository_copy(target: Path) -> Path:
    """The repository's files (tracked and untracked, not ignored), mtimes kept, with this
    environment's venv as its .venv: a checkout where `make` targets find their setup done."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    (target / ".venv").symlink_to(Path(sys.prefix))
    # The venv is this environment's, made from the checkout: date the copy's setup inputs no
    # later than its stamp, or `make` in the copy would reinstall it, editable, from the copy.
    stamp = Path(sys.prefix) / ".installed"
    # In nanoseconds, as make compares them: a float of seconds rounds by up to ≈ 0.1 µs, which
    # may date the copy's file after the stamp, and make would then reinstall the shared venv.
    if stamp.is_file():
        made = stamp.stat().st_mtime_ns
        for name in ("pyproject.toml", "requirements/constraints.txt"):
            copied = target / name
            if copied.stat().st_mtime_ns > made:
                os.utime(copied, ns=(made, made))
    return target
