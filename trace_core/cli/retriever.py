"""``trace-rl retriever ...``: build a retrieval index and serve it with Search-R1's API.

    trace-rl retriever build --task multihop --output build/index
    trace-rl retriever build --corpus s3://bucket/wiki.jsonl --model s3://bucket/e5-base-v2 \\
        --output s3://bucket/indexes/wiki-e5
    trace-rl retriever serve --index build/index --port 8000

A run searches the served index with ``--retriever-url http://HOST:PORT`` (``trace-rl train``,
``trace-rl run-local``) or the pipeline's run parameter ``retriever_url``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trace_core.cli.bench import app as bench_app
from trace_core.cli.output import console, fail, progress, write_json
from trace_core.retriever.index import HNSW_ABOVE, INDEX_TYPES, KINDS

app = typer.Typer(help="A retrieval service for the multi-hop envs (Search-R1's HTTP API).")

CACHE_ENV = "TRACE_RETRIEVER_CACHE"


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "trace-retriever")


CacheOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help=f"Where store copies of models, corpora and indexes go (default ${CACHE_ENV} or "
        "a folder in the temporary directory).",
    ),
]


@app.command("build")
def build_command(
    output: Annotated[str, typer.Option(help="A new folder or store URI for the index.")],
    corpus: Annotated[
        str | None,
        typer.Option(
            help="Parquet (id, title, text) or Search-R1's JSONL (id, contents); a path or s3://."
        ),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="Instead of --corpus, the passages of a task: multihop or hotpotqa."),
    ] = None,
    data: Annotated[str | None, typer.Option(help="The dataset of --task hotpotqa.")] = None,
    seed: Annotated[int, typer.Option(help="The seed of --task multihop's world.")] = 0,
    kind: Annotated[str, typer.Option(help=f"{' or '.join(KINDS)}.")] = "dense",
    model: Annotated[
        str,
        typer.Option(
            help="Sentence-embedding model: minilm (installed), a folder or s3:// (E5 models "
            "get their query:/passage: prefixes)."
        ),
    ] = "minilm",
    index_type: Annotated[
        str,
        typer.Option(
            help=f"{', '.join(INDEX_TYPES)}: auto is exact up to {HNSW_ABOVE:,} passages, "
            "HNSW above."
        ),
    ] = "auto",
    cache_dir: CacheOption = None,
) -> None:
    """Build a dense (faiss) or BM25 index of a corpus, recording its model and corpus."""
    from trace_core.retriever.corpus import from_passages, read_corpus
    from trace_core.retriever.encoder import Encoder
    from trace_core.retriever.index import build_index

    if (corpus is None) == (task is None):
        raise fail("give one of --corpus FILE or --task multihop|hotpotqa")
    cache = cache_dir or default_cache()
    if corpus is not None:
        passages = read_corpus(corpus, cache)
    else:
        passages = from_passages(*_task_corpus(str(task), data, seed))
    encoder = Encoder(model, cache) if kind == "dense" else None
    with progress() as bar:
        job = bar.add_task(f"embedding {len(passages):,} passages", total=len(passages))
        manifest = build_index(
            passages,
            output,
            kind,  # type: ignore[arg-type]
            encoder,
            index_type,
            progress=lambda n: bar.advance(job, n),
        )
    what = f"{kind}, {manifest.get('faiss') or 'bm25s'}" if kind == "dense" else "bm25"
    console.print(f"wrote {output}: {len(passages):,} passages ({what})")


def _task_corpus(task: str, data: str | None, seed: int) -> tuple[str, list]:  # type: ignore[type-arg]
    from trace_core.envs.suites import RETRIEVAL, make_suite

    if task not in RETRIEVAL:
        raise ValueError(f"--task {task}: only {' and '.join(RETRIEVAL)} have a corpus")
    suite = make_suite(task, data, seed)
    name = f"task:{task}" + (f":{data}" if data else f":seed={seed}")
    return name, suite.corpus()  # type: ignore[attr-defined]


@app.command("serve")
def serve_command(
    index: Annotated[str, typer.Option(help="The index folder or store URI.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model: Annotated[
        str | None,
        typer.Option(help="The query encoder (default: the model the index records)."),
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Queries searched together, at most.")] = 512,
    max_queries: Annotated[int, typer.Option(help="Queries one request may send.")] = 256,
    max_topk: Annotated[int, typer.Option(help="Largest topk a request may ask.")] = 100,
    threads: Annotated[int, typer.Option(help="Encoder threads (0: torch's default).")] = 0,
    cache_dir: CacheOption = None,
) -> None:
    """Serve an index: POST /retrieve (Search-R1's API), GET /health."""
    from trace_core.retriever.index import load_index
    from trace_core.retriever.server import Limits, serve

    if not 1 <= port <= 65535:
        raise fail(f"--port {port}: must be in 1..65535")
    cache = cache_dir or default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("trace_core.retriever").setLevel(logging.INFO)
    if threads:
        import torch

        torch.set_num_threads(threads)
    limits = Limits(max_queries=max_queries, max_topk=max_topk, max_batch=max_batch)
    console.print(f"serving {index} on http://{host}:{port} (POST /retrieve, GET /health)")
    status = serve(lambda: load_index(index, cache, model), host, port, limits)
    if status:
        raise typer.Exit(status)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise fail(f"{flag} {text}: expected comma-separated integers") from None


@bench_app.command("retriever")
def bench_retriever_command(
    passages: Annotated[int, typer.Option(help="Passages of the served dense index.")] = 100_000,
    clients: Annotated[
        str, typer.Option(help="Concurrent clients per level (with 1).")
    ] = "1,16,64",
    seconds: Annotated[float, typer.Option(help="Seconds each level sends queries.")] = 10.0,
    topk: Annotated[int, typer.Option(help="Passages per query.")] = 3,
    recall_k: Annotated[str, typer.Option(help="The k of recall@k.")] = "1,3,10",
    index_dir: Annotated[
        Path, typer.Option(help="Where the served index is built once and reused.")
    ] = Path("build/bench/retriever"),
    threads: Annotated[int, typer.Option(help="The server's encoder threads (0: default).")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Queries/s and p50/p99 latency at 1, 16 and 64 clients (each against one client's serial
    queries), and recall@k on the multihop task, dense against BM25."""
    from trace_core.retriever.bench import RetrieverBenchConfig, run_retriever_bench

    try:
        config = RetrieverBenchConfig(
            passages=passages,
            clients=_ints(clients, "--clients"),
            seconds=seconds,
            topk=topk,
            recall_k=_ints(recall_k, "--recall-k"),
            index_dir=index_dir,
            threads=threads,
        )
    except ValueError as err:
        raise fail(str(err)) from None
    result = run_retriever_bench(config, say=console.print)
    table = Table(title=f"retriever: {result['passages']:,} passages, dense (minilm, exact)")
    heads = ("clients", "queries/s", "vs 1 client", "p50 ms", "p99 ms", "mean batch", "errors")
    for head in heads:
        table.add_column(head, justify="right")
    for level in result["levels"]:  # type: ignore[attr-defined]
        table.add_row(
            str(level["clients"]),
            f"{level['qps']:,.1f}",
            f"{level['vs_serial']:.2f}×",
            f"{level['p50_ms']:.1f}",
            f"{level['p99_ms']:.1f}",
            f"{level['mean_batch']:.1f}",
            str(level["errors"]),
        )
    console.print(table)
    recall = result["recall"]
    questions, hops = recall["questions"], recall["hop_queries"]  # type: ignore[index]
    table = Table(title=f"multihop eval: {questions} questions, {hops} hop searches")
    keys = [k for k in recall["dense"]]  # type: ignore[index]
    table.add_column("index")
    for key in keys:
        table.add_column(key, justify="right")
    for kind in ("dense", "bm25"):
        table.add_row(kind, *(f"{recall[kind][k]:.3f}" for k in keys))  # type: ignore[index]
    console.print(table)
    write_json(json_path, result)
