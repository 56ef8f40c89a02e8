"""Read-only SQL over rollout trees with DuckDB: a view named ``nodes``, one row per node
(``TREE_SCHEMA``).

    source = open_trees("s3://mlpipeline/trace/run-1")     # or a local file or folder
    result = run_query(source, "SELECT strategy, avg(reward) FROM nodes WHERE is_leaf GROUP BY 1")
    write_result(result, check_output(source, Path("by-strategy.parquet")))

``trace-rl inspect query PATH_OR_URI "SQL"`` prints the result. The view is a pyarrow dataset
over the source's Parquet files, local or on S3, registered in an in-memory DuckDB. DuckDB pushes
the columns a query uses and its simple filters down into the scan, so only those column chunks
are read (on S3, as ranged GETs): ``tests/store/test_query.py`` counts the bytes.

The view is all a query can reach. Exactly one statement runs, and it must be a query (SELECT,
WITH, VALUES, ``FROM nodes``, DESCRIBE, SUMMARIZE, SHOW: what DuckDB's parser calls SELECT);
COPY, ATTACH, INSTALL, LOAD, SET, PRAGMA, CREATE and the rest are refused before anything runs.
A query still gets DuckDB's table functions, so the connection itself is closed off
(``SETTINGS`` when it opens, ``LOCKS`` once the view is registered; each checked on DuckDB 2.0.1
by ``tests/store/test_query.py``):

    enable_external_access = false     no file, URL or database: read_csv, read_text, read_blob,
                                       read_parquet, 'x.parquet', glob, COPY, ATTACH, INSTALL, LOAD
    temp_directory = ''                no spill folder, which external access leaves readable
                                       (./.tmp/); a query past DuckDB's memory limit fails instead
    autoload/autoinstall_known_extensions = false, allow_community_extensions = false
                                       sqlite_scan & co. do not fetch their extension
    python_enable_replacements = false ``FROM x`` does not find a Python variable x
    disabled_filesystems = LocalFileSystem   the in-memory database's ./:memory: (and .wal)
                                       paths, which external access allows, are closed too
    lock_configuration = true          nothing changes a setting, a table function such as
                                       enable_logging() included

The pyarrow dataset reads the trees outside DuckDB, so none of this slows the view down.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq

from trace_core.store.artifacts import LocalStore, S3Store
from trace_core.store.treeset import TreeSource

VIEW = "nodes"
OUTPUT_SUFFIXES = (".parquet", ".csv")
SETTINGS: dict[str, str | bool] = {
    "enable_external_access": False,
    "temp_directory": "",
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "python_enable_replacements": False,
}
# DuckDB takes these only once the database is running; the lock goes last.
LOCKS = ("SET disabled_filesystems = 'LocalFileSystem'", "SET lock_configuration = true")
EXAMPLE = f"e.g. SELECT strategy, count(*) FROM {VIEW} GROUP BY 1"


class QueryError(ValueError):
    """A query that is refused or fails, or a result file that is refused; the message names
    the source or the file."""


def one_query(con: duckdb.DuckDBPyConnection, sql: str) -> duckdb.Statement:
    """The single query in ``sql``, parsed by DuckDB; anything else raises ``QueryError``."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as err:
        raise QueryError(f"cannot parse the query: {err}") from None
    if len(statements) != 1:
        got = "none" if not statements else f"{len(statements)} statements"
        raise QueryError(f"only one SELECT query is allowed, got {got}; {EXAMPLE}")
    (statement,) = statements
    if statement.type != duckdb.StatementType.SELECT:
        kind, text = statement.type.name, " ".join(statement.query.split())
        text = text if len(text) <= 60 else text[:59] + "…"
        hint = "write rows with --output" if kind in ("COPY", "EXPORT") else EXAMPLE
        raise QueryError(f"only one SELECT query is allowed, got {kind} ({text}); {hint}")
    return statement


def run_query(source: TreeSource, sql: str) -> pa.Table:
    """The result of ``sql``, one query over the view ``nodes``, as an Arrow table."""
    con = duckdb.connect(config={**SETTINGS})
    try:
        statement = one_query(con, sql)  # refused before any file is opened
        con.register(VIEW, source.dataset())
        for setting in LOCKS:
            con.execute(setting)
        return con.sql(statement).to_arrow_table()
    except duckdb.Error as err:
        message = str(err)
        if isinstance(source.store, S3Store):
            message = source.store.settings.redact(message)
        if isinstance(err, duckdb.PermissionException):
            raise QueryError(
                f"query over {source.uri} refused: it reaches past the view {VIEW} ({message}); "
                f"read only from {VIEW}"
            ) from None
        raise QueryError(f"query over {source.uri} failed: {message}") from None
    finally:
        con.close()


def check_output(source: TreeSource, path: Path) -> Path:
    """``path`` if a result may be written there: a .parquet or .csv file, not one of the
    source's own files."""
    if path.suffix not in OUTPUT_SUFFIXES or path.is_dir():
        raise QueryError(f"--output {path}: name a .parquet or .csv file")
    if path.exists() and isinstance(source.store, LocalStore):
        for file in source.paths:
            if os.path.samefile(path, file):
                raise QueryError(
                    f"--output {path} is a trees file of {source.uri}; write the result elsewhere"
                )
    return path


def write_result(result: pa.Table, path: Path) -> None:
    """Write ``result`` as Parquet or CSV (by suffix): whole, or not at all.

    The rows go to a temporary file beside ``path`` that replaces it once complete.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if path.suffix == ".parquet":
            pq.write_table(result, partial)
        else:
            pyarrow.csv.write_csv(result, partial)
        os.replace(partial, path)
    except pa.ArrowException as err:
        message = f"--output {path}: cannot write the result ({err})"
        if path.suffix == ".csv":
            message += (
                "; CSV has no list columns (token ids, logprobs): leave them out or use .parquet"
            )
        raise QueryError(message) from None
    finally:
        partial.unlink(missing_ok=True)
