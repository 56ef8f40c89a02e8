"""A retrieval corpus: passages with an id and Search-R1's ``contents`` text.

Two formats, by extension: Parquet with ``id``, ``title`` (may be empty or absent) and ``text``
columns, whose ``contents`` become ``"title"\\ntext`` as in Search-R1's corpora; or Search-R1's
own JSON Lines, one ``{"id": ..., "contents": ...}`` per line. A path, ``file://`` or ``s3://``
(copied into the cache folder first). The corpus's SHA-256 is over its (id, contents) pairs in
order, so the same passages have the same digest in either format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trace_core.envs.retrieval import Passage
from trace_core.envs.source import local_path
from trace_core.store.uri import is_remote

FORMATS = (".parquet", ".jsonl")


@dataclass(frozen=True)
class Corpus:
    uri: str
    ids: tuple[str, ...]
    contents: tuple[str, ...]
    sha256: str

    def __len__(self) -> int:
        return len(self.ids)

    def to_json(self) -> dict[str, object]:
        return {"uri": self.uri, "passages": len(self), "sha256": self.sha256}


def corpus_of(uri: str, ids: Iterable[str], contents: Iterable[str]) -> Corpus:
    """A corpus from its passages; refuses a duplicate id or an empty passage, naming it."""
    ids, contents = tuple(ids), tuple(contents)
    digest = hashlib.sha256()
    seen: dict[str, int] = {}
    for row, (pid, text) in enumerate(zip(ids, contents, strict=True)):
        if pid in seen:
            raise ValueError(f"{uri}: row {row} repeats id {pid!r} (first at row {seen[pid]})")
        if not text.strip():
            raise ValueError(f"{uri}: row {row} (id {pid!r}) has no text")
        seen[pid] = row
        digest.update(json.dumps([pid, text], ensure_ascii=False).encode() + b"\n")
    if not ids:
        raise ValueError(f"{uri}: no passages")
    return Corpus(uri, ids, contents, digest.hexdigest())


def from_passages(uri: str, passages: Sequence[Passage]) -> Corpus:
    """A task's own passages (``suite.corpus()``) as a corpus named ``uri``."""
    return corpus_of(uri, (p.id for p in passages), (p.contents for p in passages))


def read_corpus(uri: str, cache: Path) -> Corpus:
    """The corpus file at ``uri`` (Parquet or JSONL; a path, ``file://`` or ``s3://``)."""
    suffix = Path(uri.split("?", 1)[0]).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(
            f"--corpus {uri}: expected a .parquet file (id, title, text) or Search-R1's .jsonl "
            "(id, contents)"
        )
    path = _local(uri, cache)
    if suffix == ".parquet":
        return _read_parquet(uri, path)
    return _read_jsonl(uri, path)


def _local(uri: str, cache: Path) -> Path:
    if not is_remote(uri):
        path = local_path(uri)
        if not path.is_file():
            raise FileNotFoundError(f"--corpus {uri}: no such file")
        return path
    from trace_core.store.sync import local_copy

    name = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(local_copy(uri, cache / "corpora", name, folder=False))


def _text_id(uri: str, row: int, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int) or str(value) == "":
        raise ValueError(f"{uri}: row {row} field 'id' is missing or not text or an integer")
    return str(value)


def _read_parquet(uri: str, path: Path) -> Corpus:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{uri}: not a readable Parquet file ({err})") from err
    missing = [c for c in ("id", "text") if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{uri}: no column {missing[0]!r}; a Parquet corpus has id, title and text"
        )
    ids = [_text_id(uri, r, v) for r, v in enumerate(table.column("id").to_pylist())]
    texts = table.column("text").to_pylist()
    titles = table.column("title").to_pylist() if "title" in table.column_names else None
    contents = []
    for row, text in enumerate(texts):
        title = "" if titles is None or titles[row] is None else titles[row]
        if not isinstance(text, str) or not isinstance(title, str):
            field = "text" if not isinstance(text, str) else "title"
            raise ValueError(f"{uri}: row {row} field {field!r} is not text")
        contents.append(Passage(ids[row], title, text).contents)
    return corpus_of(uri, ids, contents)


def _read_jsonl(uri: str, path: Path) -> Corpus:
    ids: list[str] = []
    contents: list[str] = []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{uri}: line {number} is not valid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{uri}: line {number} is not an object")
            ids.append(_text_id(uri, len(ids), row.get("id")))
            text = row.get("contents")
            if not isinstance(text, str):
                raise ValueError(f"{uri}: line {number} field 'contents' is missing or not text")
            contents.append(text)
    return corpus_of(uri, ids, contents)
