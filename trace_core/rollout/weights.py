"""Where an engine reads its weights from: a local folder, or an ``s3://`` checkpoint copied
once to each node's disk.

    folder = node_checkpoint("s3://trace/runs/nightly/iterations/0003/policy")

Engine actors on a cluster cannot see the driver's disk, so a pipeline run hands them the
policy's object-storage URI. The first actor on a node to ask downloads it (under a file lock,
into a staging folder renamed into place); the others on that node wait and find it there. The
cache lives in ``TRACE_CHECKPOINT_CACHE`` (default: ``trace-rl-checkpoints`` in the temp dir)
and keeps the ``KEEP`` most recently used checkpoints: a training run moves on to a new policy
every iteration, and older ones are removed when a new one arrives. A local path (or
``file://``) is used where it lies.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from trace_core.policy.checkpoint import CheckpointError, check_checkpoint
from trace_core.store.uri import is_remote

CACHE_ENV = "TRACE_CHECKPOINT_CACHE"
KEEP = 3
"""Checkpoints a node keeps: the one loaded, the one before it, one more in flight."""
SOURCE = "source.txt"
"""The URI a downloaded checkpoint came from, inside its folder."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir(), "trace-rl-checkpoints"))


def node_checkpoint(checkpoint: str | os.PathLike[str]) -> Path:
    """The local folder of ``checkpoint``: the path itself, or this node's copy of a remote one."""
    text = str(checkpoint)
    if not is_remote(text):
        return Path(text.removeprefix("file://"))
    from filelock import FileLock

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / hashlib.sha256(text.encode()).hexdigest()[:20]
    with FileLock(str(root / ".lock")):
        if not (folder / SOURCE).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a copy without SOURCE is a broken one
            download_checkpoint(text, folder, "engine checkpoint")
        os.utime(folder)  # most recently used
        _evict(root, keep=folder)
    return folder


def download_checkpoint(uri: str, folder: Path, what: str) -> Path:
    """The checkpoint at ``uri`` downloaded into ``folder``, whole or not at all: into a staging
    folder beside it, checked (an error names ``what`` and the URI), its URI written to
    ``SOURCE``, then renamed into place. ``folder`` must not exist."""
    from trace_core.store.sync import download_folder

    staging = folder.with_name(f".{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        download_folder(uri, staging)
        try:
            check_checkpoint(staging)
        except CheckpointError as err:
            raise CheckpointError(f"{what} {uri}: {err}") from None
        (staging / SOURCE).write_text(uri + "\n")
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _evict(root: Path, keep: Path) -> None:
    """Remove all but the ``KEEP`` most recently used copies (never ``keep``)."""
    copies = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in copies[KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
