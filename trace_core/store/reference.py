"""A folder that stands for data stored elsewhere: ``reference.json`` names where it lies, so
that a pipeline step passes a few bytes to the next instead of the data (a base model's
weights, a registry checkpoint's policy and optimizer state).

    write_reference(Path("policy"), Reference("s3://b/checkpoints/run/iter-000005-ab12/policy", 5))
    read_reference("policy")                 # Reference(uri=..., iteration=5); None: no reference
    read_reference("s3://b/staging/policy")  # the same, read from object storage

``reference.json``::

    {"kind": "trace.reference", "uri": "s3://…/iter-000005-ab12/policy", "iteration": 5}

``uri`` is an ``s3://`` (or ``minio://``) prefix or an absolute local folder (``file://`` reads
as its path): whoever reads the reference must reach it (the session's actors, on a cluster).
``iteration`` is the number of training iterations the data is after (0: a base model).
A reference never names another reference. Importable without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from trace_core.store.uri import is_remote

REFERENCE = "reference.json"
KIND = "trace.reference"


@dataclass(frozen=True)
class Reference:
    uri: str
    """Where the data lies: an object-store prefix or an absolute local folder."""
    iteration: int = 0
    """Training iterations done (0: a base model)."""

    def to_json(self) -> str:
        body = {"kind": KIND, "uri": self.uri, "iteration": self.iteration}
        return json.dumps(body, indent=2) + "\n"


def plain(location: str) -> str:
    """``location`` as the readers of a start take it: ``file://`` URIs as their path."""
    if location.lower().startswith("file://"):
        from urllib.parse import unquote, urlparse

        parsed = urlparse(location)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{location}: file:// URIs must name a local path (file:///path)")
        return unquote(parsed.path)
    return location


def write_reference(folder: Path, reference: Reference) -> None:
    """``folder/reference.json`` (the folder made); a relative local ``uri`` is refused: the
    step that reads it runs elsewhere."""
    uri = plain(reference.uri)
    if not uri or not (is_remote(uri) or Path(uri).is_absolute()):
        raise ValueError(f"reference to {reference.uri!r}: give an s3:// URI or an absolute path")
    if reference.iteration < 0:
        raise ValueError(f"reference to {uri}: iteration must be >= 0, got {reference.iteration}")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / REFERENCE
    tmp = target.with_name(f".{REFERENCE}.tmp")
    tmp.write_text(Reference(uri, reference.iteration).to_json())
    os.replace(tmp, target)


def read_reference(folder: str | os.PathLike[str]) -> Reference | None:
    """The reference ``folder`` (a path, ``file://`` or ``s3://`` prefix) holds; None when it
    holds no ``reference.json``. A damaged one is a ValueError naming the file."""
    location = plain(os.fspath(folder))
    if is_remote(location):
        from trace_core.store.artifacts import open_store

        store = open_store(location)
        if not store.exists(REFERENCE):
            return None
        where, data = store.uri(REFERENCE), store.get_bytes(REFERENCE)
    else:
        path = Path(location, REFERENCE)
        if not path.is_file():
            return None
        where, data = str(path), path.read_bytes()
    return parse_reference(data, where)


def parse_reference(data: bytes, where: str) -> Reference:
    """A ``reference.json``'s bytes, validated; ``where`` names the file in errors."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: not a reference (not valid JSON: {err})") from None
    if not isinstance(body, dict) or body.get("kind") != KIND:
        raise ValueError(f"{where}: not a reference (kind must be {KIND!r})")
    unknown = sorted(set(body) - {"kind", "uri", "iteration"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    uri, iteration = body.get("uri"), body.get("iteration", 0)
    try:
        uri = plain(uri) if isinstance(uri, str) else ""
    except ValueError:
        uri = ""
    if not (is_remote(uri) or (uri and Path(uri).is_absolute())):
        raise ValueError(f"{where}: field 'uri' must be an s3:// URI or an absolute path")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"{where}: field 'iteration' must be an integer >= 0")
    return Reference(uri, iteration)
