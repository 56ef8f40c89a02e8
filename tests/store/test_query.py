"""SQL over the trees (DuckDB, view ``nodes``): right answers, and only the needed columns read.

The bytes read are counted by a filesystem that wraps the real one (local or S3) and adds up
what every read returns: a query on two small columns must fetch a small share of the file.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from trace_core.algo.tree import RolloutTree
from trace_core.bench.store import sim_trees
from trace_core.store.artifacts import LocalStore, S3Store
from trace_core.store.query import QueryError, run_query
from trace_core.store.treeset import TreeSource, open_trees, write_tree_set


class CountingReader:
    """A file-like view of a pyarrow input file that counts the bytes handed out."""

    def __init__(self, inner: pa.NativeFile, counter: CountingHandler) -> None:
        self.inner, self.counter = inner, counter
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read() if n is None or n < 0 else self.inner.read(n)
        self.counter.add(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def size(self) -> int:
        return self.inner.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class CountingHandler(pafs.FileSystemHandler):
    """Everything goes to ``inner``; the bytes read through ``open_input_file`` are counted."""

    def __init__(self, inner: pafs.FileSystem) -> None:
        self.inner = inner
        self.bytes_read = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.PythonFile(CountingReader(self.inner.open_input_file(path), self), mode="r")

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.open_input_file(path)

    def get_type_name(self) -> str:
        return f"counting+{self.inner.type_name}"

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(selector)

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    # Writes are not part of reading; refuse them loudly.
    def _refuse(self, *args: object) -> None:
        raise NotImplementedError("read-only counting filesystem")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _refuse
    delete_file = move = copy_file = open_output_stream = open_append_stream = _refuse


def counted(source: TreeSource) -> tuple[TreeSource, CountingHandler]:
    handler = CountingHandler(source.filesystem)
    return dataclasses.replace(source, filesystem=pafs.PyFileSystem(handler)), handler


@pytest.fixture(scope="module")
def trees() -> list[RolloutTree]:
    return sim_trees(150)  # ≈5k nodes of four strategies, ≈600 KB of Parquet


def test_answers_match_a_plain_loop(tmp_path: Path, trees: list[RolloutTree]) -> None:
    write_tree_set(LocalStore(tmp_path), "trees", trees)
    got = run_query(
        open_trees(str(tmp_path)),
        "SELECT strategy, count(*) AS leaves, sum(reward) AS wins, sum(branch::INT) AS branches "
        "FROM nodes WHERE is_leaf GROUP BY strategy ORDER BY strategy",
    ).to_pylist()
    want = {}
    for t in trees:
        leaf = t.leaf_mask
        row = want.setdefault(t.info.strategy, [0, 0.0, 0])
        row[0] += int(leaf.sum())
        row[1] += float(np.nansum(t.reward[leaf]))
        row[2] += int((t.branch & leaf).sum())
    assert {r["strategy"]: [r["leaves"], r["wins"], r["branches"]] for r in got} == want


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.cluster  # a SeaweedFS server
def test_a_query_reads_only_the_columns_it_needs(
    where: str, tmp_path: Path, bucket_store: S3Store, trees: list[RolloutTree]
) -> None:
    store = LocalStore(tmp_path) if where == "local" else bucket_store
    manifest = write_tree_set(store, "trees", trees)
    file_bytes = sum(f.bytes for f in manifest.files)
    source = TreeSource.of(store, [f"trees/{f.name}" for f in manifest.files], store.uri("trees"))

    narrow, narrow_counter = counted(source)
    result = run_query(
        narrow, "SELECT count(*) AS n FROM nodes WHERE strategy = 'trace' AND reward = 1"
    )
    want = sum(int((t.reward == 1).sum()) for t in trees if t.info.strategy == "trace")
    assert result.column("n").to_pylist() == [want] and want > 0

    wide, wide_counter = counted(source)
    run_query(wide, "SELECT * FROM nodes WHERE strategy = 'trace' AND reward = 1")
    # What the narrow query may read: the strategy and reward chunks, and each file's footer
    # twice (opening the dataset reads the schema, the scan reads the row groups' metadata;
    # each fetches up to the last 64 KiB at once), plus the gaps of under 8 KiB that pyarrow's
    # read coalescing fetches around a chunk. Token ids and logprobs dominate the file.
    needed = 0
    for key in source.keys:
        fs, path = store.arrow_path(key)
        metadata = pq.ParquetFile(path, filesystem=fs).metadata
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            for c in range(group.num_columns):
                if group.column(c).path_in_schema in ("strategy", "reward"):
                    needed += group.column(c).total_compressed_size + 2 * (8 << 10)
        needed += 2 * (64 << 10)
    assert needed < 0.25 * file_bytes  # else this test would prove little
    assert narrow_counter.bytes_read <= needed, (narrow_counter.bytes_read, needed, file_bytes)
    assert wide_counter.bytes_read > 0.8 * file_bytes


def test_bad_sql_names_the_source(tmp_path: Path, trees: list[RolloutTree]) -> None:
    write_tree_set(LocalStore(tmp_path), "t", trees[:3])
    source = open_trees(str(tmp_path / "t"))
    with pytest.raises(QueryError, match=rf"query over {tmp_path}/t failed: .*nope"):
        run_query(source, "SELECT nope FROM nodes")
    assert run_query(source, "SET threads = 1").num_rows == 0  # no result set: an empty table
