"""SQL over rollout trees with DuckDB: a view named ``nodes``, one row per node (``TREE_SCHEMA``).

    source = open_trees("s3://mlpipeline/trace/run-1")     # or a local file or folder
    run_query(source, "SELECT strategy, avg(reward) FROM nodes WHERE is_leaf GROUP BY strategy")

``trace-rl inspect query PATH_OR_URI "SQL"`` prints the result. The view is a pyarrow dataset
over the source's Parquet files, local or on S3, registered in an in-memory DuckDB. DuckDB pushes
the columns a query uses and its simple filters down into the scan, so only those column chunks
are read (on S3, as ranged GETs): ``tests/store/test_query.py`` counts the bytes.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from trace_core.store.artifacts import S3Store
from trace_core.store.treeset import TreeSource

VIEW = "nodes"


class QueryError(ValueError):
    """A query that DuckDB refused or could not run; the message names the source."""


def connect(source: TreeSource) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the view ``nodes`` over ``source``."""
    con = duckdb.connect()
    con.register(VIEW, source.dataset())
    return con


def run_query(source: TreeSource, sql: str) -> pa.Table:
    """The result of ``sql`` (which reads the view ``nodes``) as an Arrow table."""
    con = connect(source)
    try:
        relation = con.sql(sql)
        # None for statements without a result (SET, CREATE VIEW, ...).
        return pa.table({}) if relation is None else relation.to_arrow_table()
    except duckdb.Error as err:
        message = str(err)
        if isinstance(source.store, S3Store):
            message = source.store.settings.redact(message)
        raise QueryError(f"query over {source.uri} failed: {message}") from None
    finally:
        con.close()
