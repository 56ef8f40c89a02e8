"""One process at a time through a block, across pytest-xdist workers: an exclusive ``flock``
on a lock file (made, with its folder, if missing), released when the block ends.

    with locked(CACHE / ".smollm2.lock"):     # fill a cache once, whichever worker comes first
        ...
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
