"""SQL over the trees (DuckDB, view ``nodes``): right answers, and only the needed columns read.

The bytes read are counted by a filesystem that wraps the real one (local or S3) and adds up
what every read returns: a query on two small columns must fetch a small share of the file.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from trace_core.algo.tree import RolloutTree
from trace_core.bench.store import sim_trees
from trace_core.store.artifacts import LocalStore, S3Store, file_sha256
from trace_core.store.query import SETTINGS, QueryError, run_query
from trace_core.store.schema import TREE_SCHEMA
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
    with pytest.raises(QueryError, match="cannot parse the query: Parser Error"):
        run_query(source, "SELEC 1")


def test_ordinary_queries_still_work(tmp_path: Path, trees: list[RolloutTree]) -> None:
    write_tree_set(LocalStore(tmp_path), "t", trees[:20])
    source = open_trees(str(tmp_path))
    leaves = sum(int(t.leaf_mask.sum()) for t in trees[:20])
    one = run_query(source, "SELECT count(*) AS n FROM nodes WHERE is_leaf;")
    assert one.column("n").to_pylist() == [leaves]
    sql = """
        WITH per_tree AS (
            SELECT max(depth) AS deepest FROM nodes GROUP BY run_id, iteration, tree_id
        )
        SELECT count(*) AS trees, max(deepest) AS deepest FROM per_tree
    """
    got = run_query(source, sql).to_pylist()
    assert got == [{"trees": 20, "deepest": max(int(t.depth.max()) for t in trees[:20])}]
    assert run_query(source, "FROM nodes SELECT text LIMIT 2").num_rows == 2
    assert run_query(source, "VALUES (1, 'a')").num_rows == 1
    described = run_query(source, "DESCRIBE nodes").column("column_name").to_pylist()
    assert described == [f.name for f in TREE_SCHEMA]
    assert run_query(source, "SUMMARIZE SELECT reward FROM nodes").num_rows == 1


# --- a query reads the view and nothing else ---------------------------------------------------
# (SQL, what the error says); {d} is the test's folder, which holds the trees (t/), a Parquet
# file that is not part of them and a text file. Statements other than one query are refused
# by DuckDB's parser before anything runs; the queries among them, by the connection's settings.
ONE_QUERY = r"only one SELECT query is allowed, got "
OUTSIDE = (
    r"query over .* refused: it reaches past the view nodes \(Permission Error: .*\); read only"
)
HOSTILE = [
    ("COPY (SELECT * FROM nodes) TO '{d}/out.csv'", ONE_QUERY + r"COPY .*; write rows with --out"),
    ("COPY nodes TO '{d}/t/{part}' (FORMAT parquet)", ONE_QUERY + "COPY"),
    ("EXPORT DATABASE '{d}/exported'", ONE_QUERY + "EXPORT"),
    ("SELECT * FROM read_csv('/etc/passwd')", OUTSIDE),
    ("SELECT * FROM read_text('{d}/secret.txt')", OUTSIDE),
    ("SELECT * FROM read_blob('{d}/secret.txt')", OUTSIDE),
    ("SELECT * FROM read_parquet('{d}/other.parquet')", OUTSIDE),
    ("SELECT * FROM '{d}/other.parquet'", OUTSIDE),
    ("SELECT * FROM nodes WHERE tree_id IN (SELECT x FROM 'other.parquet')", OUTSIDE),
    ("WITH o AS (FROM read_parquet('{d}/t/*.parquet')) SELECT count(*) FROM o", OUTSIDE),
    ("SELECT * FROM glob('/*')", OUTSIDE),
    ("SELECT * FROM read_csv('https://example.com/x.csv')", OUTSIDE),
    ("SELECT * FROM 's3://trace/x.parquet'", OUTSIDE),
    ("SELECT * FROM duckdb_extensions()", OUTSIDE),  # reads ~/.duckdb/extensions
    ("SELECT * FROM sqlite_scan('{d}/x.db', 't')", r"failed: Catalog Error: .*sqlite_scan"),
    ("SELECT * FROM enable_logging()", r"failed: .*configuration has been locked"),
    ("SELECT * FROM secret_table", r"failed: Catalog Error: .*secret_table does not exist"),
    ("ATTACH '{d}/new.db' AS new", ONE_QUERY + r"ATTACH \(ATTACH '/.*\); e\.g\. SELECT"),
    ("INSTALL httpfs", ONE_QUERY + r"LOAD \(INSTALL httpfs\)"),
    ("LOAD httpfs", ONE_QUERY + r"LOAD \(LOAD httpfs\)"),
    ("SET threads = 1", ONE_QUERY + r"SET \(SET threads = 1\)"),
    ("RESET enable_external_access", ONE_QUERY + "SET"),
    ("PRAGMA version", ONE_QUERY + "PRAGMA"),
    ("CALL pragma_version()", ONE_QUERY + "CALL"),
    ("CREATE TABLE t AS SELECT * FROM nodes", ONE_QUERY + "CREATE"),
    ("DROP VIEW nodes", ONE_QUERY + "DROP"),
    ("PIVOT nodes ON strategy", ONE_QUERY + "MULTI"),  # PIVOT first creates a type
    ("EXPLAIN SELECT 1", ONE_QUERY + "EXPLAIN"),
    ("SELECT 1; COPY nodes TO '{d}/out.csv'", ONE_QUERY + "2 statements"),
    ("SELECT 1; SELECT 2", ONE_QUERY + "2 statements"),
    ("", ONE_QUERY + "none"),
    ("-- nothing but a comment", ONE_QUERY + "none"),
]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` with its SHA-256."""
    return {
        str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture
def walled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tree_factory: Callable[..., RolloutTree]
) -> tuple[TreeSource, Path]:
    """The trees under tmp_path/t, beside files a query must not reach; tmp_path is the cwd."""
    write_tree_set(LocalStore(tmp_path), "t", [tree_factory(i) for i in range(3)])
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "other.parquet")
    (tmp_path / "secret.txt").write_text("secret\n")
    monkeypatch.chdir(tmp_path)
    return open_trees(str(tmp_path / "t")), tmp_path


@pytest.mark.parametrize(("sql", "message"), HOSTILE, ids=[sql[:40] for sql, _ in HOSTILE])
def test_a_query_reaches_nothing_but_the_view(
    sql: str, message: str, walled: tuple[TreeSource, Path]
) -> None:
    source, folder = walled
    before = snapshot(folder)
    (part,) = (k.rsplit("/", 1)[-1] for k in source.keys)
    # What "FROM secret_table" would find if DuckDB's replacement scan looked past its caller.
    secret_table = pa.table({"secret": ["in a local variable"]})  # noqa: F841
    with pytest.raises(QueryError, match=message):
        run_query(source, sql.format(d=folder, part=part))
    assert snapshot(folder) == before  # nothing written, the trees file included
    assert run_query(source, "SELECT count(*) AS n FROM nodes").column("n").to_pylist() == [24]


def test_duckdb_own_allowed_paths_are_closed_too(walled: tuple[TreeSource, Path]) -> None:
    # With external access off DuckDB still allows its spill folder (./.tmp/) and the in-memory
    # database's file names (./:memory:, ./:memory:.wal): temp_directory='' and the disabled
    # LocalFileSystem close them.
    source, folder = walled
    (folder / ".tmp").mkdir()
    (folder / ".tmp" / "spilled.csv").write_text("a\n1\n")
    (folder / ":memory:").write_text("a\n1\n")
    (folder / ":memory:.wal").write_text("a\n1\n")
    for path in (".tmp/spilled.csv", ":memory:", f"{folder}/:memory:.wal"):
        with pytest.raises(QueryError, match="refused: it reaches past the view nodes"):
            run_query(source, f"SELECT * FROM read_csv('{path}')")


def test_the_connection_settings_are_in_force(walled: tuple[TreeSource, Path]) -> None:
    source, _ = walled
    settings = run_query(source, "SELECT name, value FROM duckdb_settings()").to_pylist()
    values = {row["name"]: row["value"] for row in settings}
    want = {name: str(value).lower() for name, value in SETTINGS.items()}
    assert {name: values[name] for name in want} == want
    assert values["lock_configuration"] == "true"
    assert values["allowed_directories"] == "[]"
