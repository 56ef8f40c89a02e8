"""Tree sets: the rollout trees of one step as Parquet parts, visible once a manifest lists them.

    write_tree_set(store, "iter-000003/trees", trees)     # parts first, manifest.json last
    trees = read_tree_set(store, "iter-000003/trees")
    source = open_trees("s3://mlpipeline/trace/run-1")     # a file, a tree set, or a folder of them
    table = source.read(["strategy", "reward"])            # only those column chunks are fetched

A tree set exists once its manifest does. Readers take the files a manifest lists, never a bare
listing, so a step that crashes mid-upload leaves only unlisted parts behind (invisible; a rerun
writes parts under new names) and the manifest that was there before stays in force. Rewriting a
set replaces its manifest with one PUT (or rename): a reader sees the old set or the new one,
never half of either. Parts a replaced manifest listed are left in place for readers still using
it; nothing here deletes them.

``open_trees`` resolves what ``trace-rl inspect`` is pointed at:

- a file or object (any name; normally ``.parquet``): that file;
- a folder or prefix holding manifests, at any depth: every file they list;
- a folder or prefix without manifests: every ``.parquet`` file below it (plain files written by
  ``schema.write_trees``, e.g. by ``trace-rl rollout``).
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from trace_core.algo.tree import RolloutTree
from trace_core.store.artifacts import (
    ArtifactStore,
    ObjectNotFound,
    StoreError,
    file_sha256,
    open_store,
)
from trace_core.store.schema import (
    SCHEMA_VERSION,
    SchemaError,
    check_schema,
    from_table,
    schema_version,
    to_table,
)
from trace_core.store.schema import write_parquet as _write_parquet

MANIFEST = "manifest.json"
KIND = "trace.tree_set"
ROWS_PER_FILE = 500_000  # nodes per Parquet part (whole trees; one tree may exceed it)
FOOTER_READERS = 16  # files whose footer (schema) is read at once


class ManifestError(ValueError):
    """A manifest that cannot be read; the message names its URI and the field."""


@dataclass(frozen=True)
class PartFile:
    name: str  # relative to the manifest's folder
    rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TreeSetManifest:
    """What a tree set holds; written after every part it lists."""

    files: tuple[PartFile, ...]
    trees: int
    nodes: int
    schema_version: int = SCHEMA_VERSION
    created: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "kind": KIND,
            "schema_version": self.schema_version,
            "created": self.created,
            "trees": self.trees,
            "nodes": self.nodes,
            "files": [vars(f) for f in self.files],
            "metadata": dict(self.metadata),
        }
        return (json.dumps(body, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, uri: str) -> TreeSetManifest:
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ManifestError(f"{uri}: not valid JSON ({err})") from None
        if not isinstance(body, dict) or body.get("kind") != KIND:
            raise ManifestError(f"{uri}: not a tree-set manifest (kind must be {KIND!r})")
        files = body.get("files")
        if not isinstance(files, list):
            raise ManifestError(f"{uri}: field 'files' must be a list")
        parts = []
        for i, entry in enumerate(files):
            if not isinstance(entry, dict):
                raise ManifestError(f"{uri}: files[{i}] must be an object")
            name = _field(entry, "name", str, uri, f"files[{i}].")
            if "/" in name or name in ("", ".", ".."):
                raise ManifestError(f"{uri}: files[{i}].name {name!r} must be a plain file name")
            parts.append(
                PartFile(
                    name,
                    _field(entry, "rows", int, uri, f"files[{i}]."),
                    _field(entry, "bytes", int, uri, f"files[{i}]."),
                    _field(entry, "sha256", str, uri, f"files[{i}]."),
                )
            )
        version = _field(body, "schema_version", int, uri)
        if version > SCHEMA_VERSION:
            raise ManifestError(
                f"{uri}: schema version {version} is newer than this reader's {SCHEMA_VERSION}"
            )
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ManifestError(f"{uri}: field 'metadata' must be an object")
        return cls(
            files=tuple(parts),
            trees=_field(body, "trees", int, uri),
            nodes=_field(body, "nodes", int, uri),
            schema_version=version,
            created=str(body.get("created", "")),
            metadata={str(k): str(v) for k, v in metadata.items()},
        )


_V = TypeVar("_V", int, str)


def _field(obj: Mapping[str, object], name: str, kind: type[_V], uri: str, where: str = "") -> _V:
    value = obj.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ManifestError(f"{uri}: field {where}{name} must be {kind.__name__}, got {value!r}")
    return value


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def write_tree_set(
    store: ArtifactStore,
    prefix: str,
    trees: Sequence[RolloutTree],
    *,
    metadata: Mapping[str, str] | None = None,
    rows_per_file: int = ROWS_PER_FILE,
    progress: Callable[[int], None] | None = None,
) -> TreeSetManifest:
    """Upload ``trees`` as Parquet parts under ``prefix``, then its manifest.

    ``progress`` is called with the number of trees uploaded so far.
    """
    token = uuid.uuid4().hex[:12]  # fresh part names: a rerun never overwrites a listed part
    parts, done = [], 0
    with tempfile.TemporaryDirectory(prefix="trace-trees-") as tmp:
        for i, chunk in enumerate(_chunks(trees, rows_per_file)):
            table = to_table(chunk)
            local = Path(tmp) / f"part-{i}.parquet"
            _write_parquet(table, local)
            name = f"part-{token}-{i:04d}.parquet"
            store.put_file(join_key(prefix, name), local)
            parts.append(PartFile(name, table.num_rows, local.stat().st_size, file_sha256(local)))
            local.unlink()
            done += len(chunk)
            if progress:
                progress(done)
    manifest = TreeSetManifest(
        files=tuple(parts),
        trees=len(trees),
        nodes=sum(p.rows for p in parts),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        metadata=dict(metadata or {}),
    )
    store.put_bytes(join_key(prefix, MANIFEST), manifest.to_json())
    return manifest


def _chunks(trees: Sequence[RolloutTree], rows: int) -> list[Sequence[RolloutTree]]:
    chunks: list[Sequence[RolloutTree]] = []
    start, size = 0, 0
    for i, tree in enumerate(trees):
        if size and size + tree.size > rows:
            chunks.append(trees[start:i])
            start, size = i, 0
        size += tree.size
    if start < len(trees) or not chunks:
        chunks.append(trees[start:])
    return chunks


def read_manifest(store: ArtifactStore, prefix: str) -> TreeSetManifest:
    key = join_key(prefix, MANIFEST)
    try:
        data = store.get_bytes(key)
    except ObjectNotFound:
        raise ObjectNotFound(
            f"{store.uri(key)}: no manifest: not a tree set, or one still being written"
        ) from None
    return TreeSetManifest.from_json(data, store.uri(key))


def read_tree_set(store: ArtifactStore, prefix: str) -> list[RolloutTree]:
    """Every tree of the set whose manifest is at ``prefix``; the part sizes are checked."""
    manifest = read_manifest(store, prefix)
    keys = tuple(join_key(prefix, f.name) for f in manifest.files)
    source = TreeSource.of(store, keys, store.uri(prefix))
    table = source.read()
    if table.num_rows != manifest.nodes:
        raise ManifestError(
            f"{store.uri(join_key(prefix, MANIFEST))}: lists {manifest.nodes} nodes, "
            f"its parts hold {table.num_rows}"
        )
    return from_table(table)


# --- reading for inspection --------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSource:
    """Parquet files of rollout trees in one store, read through pyarrow (columns on demand)."""

    uri: str  # what the user named
    store: ArtifactStore
    keys: tuple[str, ...]
    filesystem: pafs.FileSystem  # a test may wrap it to count the bytes read

    @classmethod
    def of(cls, store: ArtifactStore, keys: Sequence[str], uri: str) -> TreeSource:
        filesystem = store.arrow_path("")[0]
        return cls(uri, store, tuple(keys), filesystem)

    @property
    def paths(self) -> list[str]:
        return [self.store.arrow_path(k)[1] for k in self.keys]

    def dataset(self) -> ds.Dataset:
        """A dataset over every file; each file's schema is checked against ``TREE_SCHEMA``.

        A folder may hold a stray Parquet file; unchecked, its rows would come back as nulls.
        Only the footers are read (in parallel, for S3's round trips), and the scan reuses
        them rather than fetching them again.
        """
        if not self.keys:
            raise ObjectNotFound(f"{self.uri}: no rollout tree files to read")
        parquet = ds.ParquetFileFormat()
        fragments = [parquet.make_fragment(p, filesystem=self.filesystem) for p in self.paths]
        with ThreadPoolExecutor(min(FOOTER_READERS, len(fragments))) as pool:
            schemas = list(pool.map(self._file_schema, self.keys, fragments))
        # The newest version's columns; older files read as nulls in the columns they lack.
        newest = max(schemas, key=schema_version)
        return ds.FileSystemDataset(fragments, newest, parquet, self.filesystem)

    def _file_schema(self, key: str, fragment: ds.ParquetFileFragment) -> pa.Schema:
        try:
            schema = fragment.physical_schema  # the footer, kept by the fragment for the scan
        except (OSError, pa.ArrowException) as err:
            raise self.error(err) from None
        try:
            check_schema(schema)
        except SchemaError as err:
            uri = self.store.uri(key)
            if uri == self.uri:
                raise SchemaError(f"{uri}: {err}") from None
            raise SchemaError(
                f"{uri}: {err}; every file under {self.uri} must hold rollout trees"
            ) from None
        return schema

    def read(
        self, columns: Sequence[str] | None = None, filter: ds.Expression | None = None
    ) -> pa.Table:
        """The rows matching ``filter``, only ``columns`` (all when None)."""
        dataset = self.dataset()
        try:
            return dataset.to_table(columns=list(columns) if columns else None, filter=filter)
        except (OSError, pa.ArrowException) as err:
            raise self.error(err) from None

    def error(self, err: BaseException) -> StoreError:
        """A read error as a ``StoreError`` naming the source (and the file when known)."""
        text = str(err)
        key = next((k for k, p in zip(self.keys, self.paths, strict=True) if p in text), "")
        wrapped = self.store.arrow_error(key, err)
        if not key and self.uri not in str(wrapped):
            return type(wrapped)(f"{self.uri}: {wrapped}")
        return wrapped


def open_trees(uri: str) -> TreeSource:
    """The trees at ``uri``: one file, a tree set, or a folder/prefix of them (module docstring)."""
    store = open_store(uri)
    if store.exists(""):
        return TreeSource.of(store, ("",), store.uri(""))
    objects = store.list_objects("")
    if not objects:
        raise ObjectNotFound(f"{store.uri('')}: no such file, folder or prefix (or it is empty)")
    sizes = {o.key: o.size for o in objects}
    manifests = [o.key for o in objects if o.key.rsplit("/", 1)[-1] == MANIFEST]
    keys: list[str] = []
    for key in manifests:
        folder = key[: -len(MANIFEST)].rstrip("/")
        for part in read_manifest(store, folder).files:
            part_key = join_key(folder, part.name)
            if part_key not in sizes:
                raise ObjectNotFound(
                    f"{store.uri(part_key)}: listed in {store.uri(key)} but missing"
                )
            keys.append(part_key)
    if not manifests:
        keys = [o.key for o in objects if o.key.endswith(".parquet")]
    if not keys:
        raise ObjectNotFound(
            f"{store.uri('')}: no rollout trees here (no {MANIFEST} and no .parquet files)"
        )
    return TreeSource.of(store, keys, store.uri(""))
