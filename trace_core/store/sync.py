"""Copy a folder between the local disk and a store URI (a path, ``file://``, ``s3://``).

    upload_folder("runs/policy", "s3://mlpipeline/trace/staging/ab12/policy")
    download_folder("s3://mlpipeline/trace/staging/ab12/policy", "/tmp/policy")

What a pipeline step sent to a Ray cluster exchanges with the step that sent it: the inputs go
up before the job starts, the outputs come down after it ends. The folder's files are copied
one by one (multipart on S3); ``download_folder`` fails naming the URI when nothing is there,
so a job that wrote no output is an error and never an empty artifact. ``put_trees`` and
``get_trees`` hand one iteration's trees to the trainer actors through the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trace_core.store.artifacts import ObjectNotFound, open_store
from trace_core.store.uri import is_remote

if TYPE_CHECKING:
    from trace_core.algo.tree import RolloutTree


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


TREES_FILE = "trees.parquet"


def put_trees(uri: str, trees: Sequence[RolloutTree]) -> None:
    """``trees`` as ``trees.parquet`` below ``uri`` (a folder or ``s3://`` prefix), in one
    write: a reader finds the whole file or none."""
    import io

    from trace_core.store.schema import to_table, write_parquet

    buffer = io.BytesIO()
    write_parquet(to_table(trees), buffer)
    open_store(uri).put_bytes(TREES_FILE, buffer.getvalue())


def get_trees(uri: str) -> list[RolloutTree]:
    """The trees ``put_trees`` (or a step) stored below ``uri``; a missing or unreadable file
    is named in the error."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from trace_core.store.schema import SchemaError, from_table

    store = open_store(uri)
    data = store.get_bytes(TREES_FILE)
    try:
        return from_table(pq.read_table(io.BytesIO(data)))
    except (pa.ArrowException, SchemaError) as err:
        raise SchemaError(f"{store.uri(TREES_FILE)}: not trees ({err})") from None
