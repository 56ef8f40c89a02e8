"""Copy a folder between the local disk and a store URI (a path, ``file://``, ``s3://``).

    upload_folder("runs/policy", "s3://mlpipeline/trace/staging/ab12/policy")
    download_folder("s3://mlpipeline/trace/staging/ab12/policy", "/tmp/policy")

What a pipeline step sent to a Ray cluster exchanges with the step that sent it: the inputs go
up before the job starts, the outputs come down after it ends. The folder's files are copied
one by one (multipart on S3); ``download_folder`` fails naming the URI when nothing is there,
so a job that wrote no output is an error and never an empty artifact.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from trace_core.store.artifacts import ObjectNotFound, open_store
from trace_core.store.uri import is_remote


def upload_folder(folder: str | os.PathLike[str], uri: str) -> int:
    """Every file under ``folder`` to the same relative keys below ``uri``; returns the count."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder to upload")
    store = open_store(uri)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        store.put_file(path.relative_to(root).as_posix(), path)
    return len(files)


def download_folder(
    uri: str, folder: str | os.PathLike[str], keep: Callable[[str], bool] | None = None
) -> int:
    """Every object below ``uri`` (those whose key ``keep`` accepts, if given) into ``folder``
    (created); returns the count."""
    store = open_store(uri)
    objects = store.list_objects("")
    if not objects:
        raise ObjectNotFound(f"{store.uri('')}: nothing to download (no such folder or prefix)")
    root = Path(folder)
    for obj in objects:
        if keep is not None and not keep(obj.key):
            continue
        target = root / obj.key
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(obj.key, target)
    return len(objects)


def local_copy(location: str, scratch: Path, name: str, folder: bool) -> str:
    """A local copy of an input: the path itself, or its download (a folder, or one file)
    into ``scratch / name``."""
    if not is_remote(location):
        return location
    target = scratch / name
    if folder:
        download_folder(location, target)
        return str(target)
    parent, _, key = location.rstrip("/").rpartition("/")
    target.mkdir(parents=True, exist_ok=True)
    open_store(parent).get_file(key, target / key)
    return str(target / key)
