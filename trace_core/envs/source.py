"""Where dataset files come from: a local path or URI in, the rows of a JSON/JSONL/Parquet file out.

    rows = read_records("data/deepscaler.json")          # a JSON list of objects
    rows = read_records("file:///data/train.parquet")    # one dict per Parquet row
    rows = read_records("s3://bucket/train.jsonl")       # through trace_core.store (AWS_* env)

``s3://`` (and KFP's ``minio://``) objects are fetched by the artifact store,
``trace_core.store.artifacts``, with credentials and endpoint from the environment; it is imported
only when such a URI is read, so the envs layer keeps its light imports. The format comes from the
extension, so a file is never parsed as something it is not. Rows come back unvalidated: each
loader checks its own fields and names the row that is wrong.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

from trace_core.store.uri import is_remote

Format = Literal["json", "jsonl", "parquet"]

_FORMATS: dict[str, Format] = {".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}


_OBJECT_STORES = ("s3", "minio")


def local_path(uri: str) -> Path:
    """The local file a path or ``file://`` URI names; a clear error for other schemes."""
    if "://" not in uri:
        return Path(uri)
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri}: file:// URIs must name a local file (file:///path)")
        return Path(unquote(parsed.path))
    if scheme in _OBJECT_STORES:
        raise ValueError(f"{uri}: an object-store URI, not a local file; use open_source")
    raise ValueError(
        f"{uri}: unsupported URI scheme {scheme!r}; use a local path, file:// or s3://"
    )


def source_format(uri: str) -> Format:
    """JSON, JSON Lines or Parquet, by the file's extension."""
    suffix = Path(urlparse(uri).path if "://" in uri else uri).suffix.lower()
    if suffix not in _FORMATS:
        raise ValueError(
            f"{uri}: unknown dataset format {suffix or '(no extension)'!r}; "
            "expected .json (a list of objects), .jsonl (one object per line) or .parquet"
        )
    return _FORMATS[suffix]


def open_source(uri: str) -> bytes:
    """The bytes of the file at ``uri``: local, or an S3 object through the artifact store.

    A missing object is a ``FileNotFoundError`` and missing credentials a ``PermissionError``
    (both ``trace_core.store.artifacts.StoreError``s naming the URI), as for local files.
    """
    if is_remote(uri):
        from trace_core.store.artifacts import read_uri

        return read_uri(uri)
    path = local_path(uri)
    if not path.is_file():
        raise FileNotFoundError(f"{uri}: no such file")
    return path.read_bytes()


def read_records(uri: str) -> list[object]:
    """The rows of a dataset file: a JSON list, JSON Lines, or a Parquet table as dicts."""
    if not is_remote(uri):
        local_path(uri)  # an unsupported scheme is the first thing to say
    fmt = source_format(uri)
    data = open_source(uri)
    if fmt == "parquet":
        # Lazily imported: pyarrow is only needed by those who read Parquet.
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{uri}: not a readable Parquet file ({err})") from err
        return list(table.to_pylist())
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{uri}: not UTF-8 text ({err})") from err
    if fmt == "jsonl":
        rows: list[object] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{uri}: line {number} is not valid JSON ({err.msg})") from err
        return rows
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{uri}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from err
    if not isinstance(loaded, list):
        raise ValueError(f"{uri}: expected a JSON list of objects, got {type(loaded).__name__}")
    return loaded
