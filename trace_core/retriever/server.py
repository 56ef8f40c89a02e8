"""The retrieval server: Search-R1's HTTP API over a loaded index.

    POST /retrieve  {"queries": ["..."], "topk": 3, "return_scores": true}
        -> {"result": [[{"document": {"id": "...", "contents": "..."}, "score": 0.8}, ...]]}
           (without return_scores each hit is the document itself)
    GET /health     200 {"status": "ok", ...} once the index is loaded, 503 while it loads

The index loads in a thread after the port opens, so probes see 503 rather than a refused
connection; a load that fails stops the server with exit status 1 and one line saying why.
Queries of concurrent requests are searched together: one worker thread takes every query
waiting when it finishes a batch (up to ``max_batch``), encodes them in one forward pass and
searches them in one faiss call. Nothing is waited for to fill a batch, so a lone query is not
delayed. A request is read up to ``max_body_bytes`` and checked field by field; anything else
gets a 4xx with a one-line ``detail``. No request names a file, a model or a setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from trace_core.retriever.index import Hits, LoadedIndex

log = logging.getLogger("trace_core.retriever")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_queries: int = 256
    max_query_chars: int = 2_000
    max_topk: int = 100
    default_topk: int = 3
    max_batch: int = 512
    """Queries searched in one pass, across requests."""


class BadRequest(ValueError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


def parse_request(body: bytes, limits: Limits) -> tuple[list[str], int, bool]:
    """``(queries, topk, return_scores)`` of a /retrieve body, or ``BadRequest`` saying why."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(400, f"the body is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise BadRequest(400, f"the body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"queries", "topk", "return_scores"})
    if unknown:
        raise BadRequest(
            400, f"unknown field {unknown[0]!r}; expected queries, topk, return_scores"
        )
    queries = data.get("queries")
    if not isinstance(queries, list) or not queries:
        raise BadRequest(400, "'queries' must be a non-empty list of strings")
    if len(queries) > limits.max_queries:
        raise BadRequest(
            413, f"'queries' holds {len(queries)} queries; the limit is {limits.max_queries}"
        )
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise BadRequest(400, f"'queries'[{i}] must be a string, got {type(query).__name__}")
        if len(query) > limits.max_query_chars:
            raise BadRequest(
                413,
                f"'queries'[{i}] is {len(query)} characters; the limit is {limits.max_query_chars}",
            )
    topk = data.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise BadRequest(400, f"'topk' must be an integer in [1, {limits.max_topk}], got {topk!r}")
    scores = data.get("return_scores", False)
    if not isinstance(scores, bool):
        raise BadRequest(400, f"'return_scores' must be true or false, got {scores!r}")
    return queries, topk, scores


@dataclass
class _Waiting:
    queries: list[str]
    topk: int
    future: asyncio.Future[Hits]


@dataclass
class Batcher:
    """One worker thread searching every waiting query at once; ``batches`` counts its passes."""

    search: Callable[[list[str], int], Hits]
    max_batch: int
    queue: asyncio.Queue[_Waiting] = field(default_factory=asyncio.Queue)
    batches: int = 0
    queries: int = 0
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="retrieve")
    )

    async def submit(self, queries: list[str], topk: int) -> Hits:
        future: asyncio.Future[Hits] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Waiting(queries, topk, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            size = len(batch[0].queries)
            while not self.queue.empty() and size < self.max_batch:
                batch.append(self.queue.get_nowait())
                size += len(batch[-1].queries)
            texts = [q for waiting in batch for q in waiting.queries]
            topk = max(waiting.topk for waiting in batch)
            try:
                hits = await loop.run_in_executor(self._pool, self.search, texts, topk)
            except Exception as err:  # one bad batch fails its requests, not the server
                log.exception("search failed")
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(err)
                continue
            self.batches += 1
            self.queries += len(texts)
            start = 0
            for waiting in batch:
                mine = hits[start : start + len(waiting.queries)]
                start += len(waiting.queries)
                if not waiting.future.done():  # its client may have gone
                    waiting.future.set_result([row[: waiting.topk] for row in mine])


class Service:
    """The index being loaded or loaded, and the app answering over it."""

    def __init__(
        self, load: Callable[[], LoadedIndex], limits: Limits, on_failure: Callable[[], None]
    ) -> None:
        self.limits = limits
        self.index: LoadedIndex | None = None
        self.error: str | None = None
        self._load, self._on_failure = load, on_failure
        self.batcher: Batcher | None = None
        self.app = self._app()

    def _load_in_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            index = self._load()
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}".splitlines()[0]
            log.error("the index did not load: %s", self.error)
            loop.call_soon_threadsafe(self._on_failure)
            return
        loop.call_soon_threadsafe(self._ready, index)

    def _ready(self, index: LoadedIndex) -> None:
        self.batcher = Batcher(index.search, self.limits.max_batch)
        self._worker = asyncio.get_running_loop().create_task(self.batcher.run())
        self.index = index
        log.info("ready: %d passages (%s)", len(index.ids), index.kind)

    def _app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            loop = asyncio.get_running_loop()
            threading.Thread(target=self._load_in_thread, args=(loop,), daemon=True).start()
            yield

        app = FastAPI(
            title="TRACE retriever",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            lifespan=lifespan,
        )

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.index is None:
                status = "failed" if self.error else "loading"
                return JSONResponse({"status": status, "error": self.error}, status_code=503)
            return JSONResponse(
                {
                    "status": "ok",
                    "kind": self.index.kind,
                    "passages": len(self.index.ids),
                    "model": self.index.model_uri,
                    "batches": self.batcher.batches if self.batcher else 0,
                    "queries": self.batcher.queries if self.batcher else 0,
                }
            )

        @app.post("/retrieve")
        async def retrieve(request: Request) -> Response:
            try:
                body = await self._read_body(request)
                queries, topk, scores = parse_request(body, self.limits)
            except BadRequest as err:
                return JSONResponse({"detail": str(err)}, status_code=err.status)
            if self.index is None or self.batcher is None:
                return JSONResponse({"detail": "the index is still loading"}, status_code=503)
            hits = await self.batcher.submit(queries, topk)
            return Response(self._answer(hits, scores), media_type="application/json")

        return app

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise BadRequest(413, f"the body is over {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BadRequest(413, f"the body is over {limit} bytes")
        return bytes(body)

    def _answer(self, hits: Hits, scores: bool) -> bytes:
        assert self.index is not None
        ids, contents = self.index.ids, self.index.contents
        result: list[list[Any]] = []
        for row in hits:
            docs = [({"id": ids[r], "contents": contents[r]}, s) for r, s in row]
            if scores:
                result.append([{"document": d, "score": s} for d, s in docs])
            else:
                result.append([d for d, _ in docs])
        return json.dumps({"result": result}, ensure_ascii=False).encode()


def serve(
    load: Callable[[], LoadedIndex], host: str, port: int, limits: Limits | None = None
) -> int:
    """Serve until stopped (SIGTERM/SIGINT: 0) or until the index fails to load (1)."""
    import uvicorn

    failed = threading.Event()
    server: uvicorn.Server | None = None

    def stop() -> None:
        failed.set()
        assert server is not None
        server.should_exit = True

    service = Service(load, limits or Limits(), stop)
    config = uvicorn.Config(
        service.app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
        limit_concurrency=1024,
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if failed.is_set() else 0
