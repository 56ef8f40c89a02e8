"""Search through a retrieval service over HTTP, Search-R1's API: the multihop envs' search when
a run names ``retriever_url``.

    search = RemoteSearch("http://trace-retriever:8000")
    search.search("bo lin born", 2)   # ["bo lin was born in kara .", "bo lin lives in tovi ."]

``POST {url}/retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id": ..., "contents": ...}, "score": ...}, ...], ...]}``, one list
per query, best first; ``search`` renders each ``contents`` as the in-process index shows a
passage (``retrieval.render``).

Connections are pooled and kept alive: one urllib3 pool per process, shared by the threads
that step a suite's envs. A connection error, a timeout or a 5xx (503 while the service loads
its index) is tried again after an exponential backoff, ``retries`` times; then
``RetrieverUnavailable``, one line naming the URL, which a rollout turns into a dropped prompt
(``rollout.grow``), not a failed run. A 4xx is the request's fault: a ValueError with the
server's reason, not retried. A call takes at most ``deadline_s`` in all (a server that answers
byte by byte included), so the env calls it as it is, not under the in-process tools' bound.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import urllib3

from trace_core.envs.base import ToolTimeout, bounded_call
from trace_core.envs.retrieval import render

_REASON_CHARS = 200
"""Longest server reason or error an exception message quotes."""
MAX_QUERY_CHARS = 2_000
"""Longest query ``search`` sends (the service's default limit, ``retriever.server.Limits``);
an agent's longer query is cut to it, not refused: nothing the agent writes may raise."""


class RetrieverUnavailable(ConnectionError):
    """The retrieval service gave no answer after every attempt."""


def check_retriever_url(url: object) -> str:
    """``url`` without its trailing slash; a ValueError naming ``retriever_url`` unless it is
    http(s)://HOST[:PORT][/PATH]."""
    if not isinstance(url, str):
        raise ValueError(f"retriever_url must be text (http(s)://HOST[:PORT]), got {url!r}")
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or out of range
        port_ok = False
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not port_ok
        or parts.query
        or parts.fragment
        or any(c.isspace() for c in url)
    ):
        raise ValueError(
            f"retriever_url {url!r}: expected http(s)://HOST[:PORT] of the retrieval service "
            "(Search-R1's /retrieve), or empty for the in-process index"
        )
    return url.rstrip("/")


class RemoteSearch:
    """A retrieval service at ``url`` as the multihop env's search (``retrieval.Searcher``).

    ``timeout_s`` bounds each attempt's connect and each read; ``retries`` more attempts follow
    a failed one, the i-th after ``backoff_s * 2**i`` seconds; ``pool_size`` connections are
    kept alive; ``search`` cuts a query to ``max_query_chars``. Picklable: the pool is left
    behind and made again on first use.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        pool_size: int = 32,
        max_query_chars: int = MAX_QUERY_CHARS,
    ) -> None:
        self.url = check_retriever_url(url)
        if not timeout_s > 0 or retries < 0 or backoff_s < 0 or min(pool_size, max_query_chars) < 1:
            raise ValueError(
                "RemoteSearch needs timeout_s > 0, retries >= 0, backoff_s >= 0, pool_size >= 1 "
                f"and max_query_chars >= 1, got {timeout_s}, {retries}, {backoff_s}, {pool_size}, "
                f"{max_query_chars}"
            )
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.pool_size = backoff_s, pool_size
        self.max_query_chars = max_query_chars
        self._pool: urllib3.PoolManager | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def deadline_s(self) -> float:
        """The longest one call takes: every attempt at its connect and read timeouts, and the
        waits between them."""
        waits = sum(self.backoff_s * 2**i for i in range(self.retries))
        return (self.retries + 1) * 2 * self.timeout_s + waits

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"], state["_lock"], state["_pid"] = None, None, 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteSearch({self.url!r})"

    def search(self, query: str, k: int) -> list[str]:
        """The ``k`` best passages for ``query``, best first, each as one observation line."""
        (found,) = self.retrieve([query[: self.max_query_chars]], k)
        return [render(_document(item)["contents"]) for item in found[:k]]

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        """The service's result lists, one per query, as it sent them (each item a
        ``{"document": {"id", "contents"}, "score"}``); checked for Search-R1's shape."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not all(isinstance(q, str) for q in queries):
            raise ValueError("queries must be a list of strings")
        if not queries:
            return []
        body = {"queries": list(queries), "topk": topk, "return_scores": True}
        try:
            answer = bounded_call(lambda: self._post("/retrieve", body), self.deadline_s + 1.0)
        except ToolTimeout:
            raise RetrieverUnavailable(
                f"retriever {self.url}: no answer within {self.deadline_s:g} s"
            ) from None
        return self._checked(answer, len(queries))

    def _checked(self, answer: object, queries: int) -> list[list[dict[str, Any]]]:
        result = answer.get("result") if isinstance(answer, dict) else None
        shaped = (
            isinstance(result, list)
            and len(result) == queries
            and all(isinstance(found, list) for found in result)
        )
        if shaped:
            assert isinstance(result, list)
            shaped = all(_is_item(item) for found in result for item in found)
        if not shaped:
            raise ValueError(
                f"retriever {self.url}/retrieve: the answer is not Search-R1's "
                '{"result": [[{"document": {"id": ..., "contents": ...}, "score": ...}, ...]]} '
                f"with one list for each of the {queries} queries"
            )
        return result  # type: ignore[return-value]

    def _post(self, path: str, body: dict[str, object]) -> object:
        """POST ``body`` as JSON, retried as the module docstring says; the answer's JSON."""
        url, data = self.url + path, json.dumps(body).encode()
        timeout = urllib3.Timeout(connect=self.timeout_s, read=self.timeout_s)
        attempts, last = self.retries + 1, ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._pool_manager().request(
                    "POST",
                    url,
                    body=data,
                    headers={"Content-Type": "application/json"},
                    timeout=timeout,
                    retries=False,
                    redirect=False,
                )
            except urllib3.exceptions.HTTPError as err:  # connection errors and timeouts
                last = _clip(f"{type(err).__name__}: {err}")
                continue
            if response.status >= 500:
                last = f"HTTP {response.status}: {_reason(response.data)}"
                continue
            if response.status != 200:
                raise ValueError(
                    f"retriever {url}: HTTP {response.status}: {_reason(response.data)}"
                )
            try:
                return json.loads(response.data)
            except ValueError:
                raise ValueError(f"retriever {url}: the answer is not JSON") from None
        raise RetrieverUnavailable(
            f"retriever {self.url}: no answer after {attempts} attempts (last: {last})"
        )

    def _pool_manager(self) -> urllib3.PoolManager:
        """The process's pool (a forked child makes its own)."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = urllib3.PoolManager(maxsize=self.pool_size, retries=False)
                self._pid = os.getpid()
            return self._pool


def _document(item: dict[str, Any]) -> dict[str, Any]:
    """The document of a result item: ``item["document"]`` with scores, else the item."""
    document = item.get("document", item)
    assert isinstance(document, dict)
    return document


def _is_item(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    document = item.get("document", item)
    return isinstance(document, dict) and isinstance(document.get("contents"), str)


def _reason(data: bytes) -> str:
    """The server's one-line reason: FastAPI's ``detail``, else the body's text."""
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if detail is None:
        text = data.decode("utf-8", "replace")
    else:
        text = detail if isinstance(detail, str) else json.dumps(detail)
    return _clip(text) or "(no reason given)"


def _clip(text: str) -> str:
    """``text`` on one line, at most ``_REASON_CHARS`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."
