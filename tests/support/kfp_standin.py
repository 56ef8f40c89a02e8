"""A stand-in KFP API server on 127.0.0.1 for the client tests and the deploy guide's commands.

It answers the KFP v2beta1 REST paths the SDK calls for upload, run, schedule and runs, keeps just
enough state (pipelines, versions, experiments, runs) to answer follow-up calls, and records every
request. It checks *our* calls, not KFP: it accepts what the real API server might reject.

    with serving(StandIn()) as state:   # state.url: http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import contextlib
import email.parser
import email.policy
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

API = "/apis/v2beta1"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: dict[str, object] | None = None  # JSON bodies
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # multipart: name -> file


@dataclass
class StandIn:
    """State and request log of the stand-in KFP API (one per test)."""

    url: str = ""
    requests: list[Request] = field(default_factory=list)
    pipelines: dict[str, dict[str, object]] = field(default_factory=dict)  # id -> pipeline
    versions: dict[str, list[dict[str, object]]] = field(default_factory=dict)  # pipeline id ->
    experiments: dict[str, dict[str, object]] = field(default_factory=dict)
    runs: list[dict[str, object]] = field(default_factory=list)
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    reject: bool = False  # answer 401 to everything, echoing the Authorization header

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids):04d}"

    def calls(self) -> list[tuple[str, str]]:
        """(method, path) of every request but the SDK's health check."""
        return [(r.method, r.path) for r in self.requests if r.path != f"{API}/healthz"]

    def last(self, method: str, path: str) -> Request:
        return next(r for r in reversed(self.requests) if (r.method, r.path) == (method, path))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _display_name_filter(query: dict[str, str]) -> str | None:
    if "filter" not in query:
        return None
    predicates = json.loads(query["filter"])["predicates"]
    return next(p["stringValue"] for p in predicates if p["key"] == "display_name")


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str, bytes]]:
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    return {
        part.get_param("name", header="content-disposition"): (
            part.get_filename() or "",
            part.get_payload(decode=True),
        )
        for part in message.iter_parts()
    }


def _route(state: StandIn, req: Request) -> tuple[int, dict[str, object]]:
    """The v2beta1 paths kfp.Client uses for upload, run, schedule and list."""
    q, path, method = req.query, req.path, req.method
    if state.reject:  # a careless server: the error body repeats the credentials
        return 401, {"error": f"bad credentials: {req.headers.get('authorization')}", "code": 16}
    match method, path:
        case "GET", "/apis/v2beta1/healthz":
            return 200, {"multi_user": False}
        case "GET", "/apis/v2beta1/pipelines":
            name = _display_name_filter(q)
            found = [p for p in state.pipelines.values() if name in (None, p["display_name"])]
            return 200, {"pipelines": found, "total_size": len(found)} if found else {}
        case "POST", "/apis/v2beta1/pipelines/upload":
            pipeline_id = state.new_id("pipeline")
            pipeline = {"pipeline_id": pipeline_id, "display_name": q["name"], "created_at": _now()}
            state.pipelines[pipeline_id] = pipeline
            version = {
                "pipeline_id": pipeline_id,
                "pipeline_version_id": state.new_id("version"),
                "display_name": q["name"],
                "created_at": _now(),
            }
            state.versions[pipeline_id] = [version]
            return 200, pipeline
        case "POST", "/apis/v2beta1/pipelines/upload_version":
            if q.get("pipelineid") not in state.pipelines:
                return 404, {"error": f"pipeline {q.get('pipelineid')} not found", "code": 5}
            version = {
                "pipeline_id": q["pipelineid"],
                "pipeline_version_id": state.new_id("version"),
                "display_name": q["name"],
                "created_at": _now(),
            }
            state.versions[q["pipelineid"]].append(version)
            return 200, version
        case "GET", _ if m := re.fullmatch(r"/apis/v2beta1/pipelines/([^/]+)/versions", path):
            versions = list(state.versions.get(m[1], []))
            if (name := _display_name_filter(q)) is not None:
                versions = [v for v in versions if v["display_name"] == name]
            if q.get("sort_by") == "created_at desc":
                versions.reverse()  # stored oldest first
            versions = versions[: int(q.get("page_size", 10))]
            return 200, {"pipeline_versions": versions} if versions else {}
        case "GET", "/apis/v2beta1/experiments":
            name = _display_name_filter(q)
            found = [e for e in state.experiments.values() if name in (None, e["display_name"])]
            return 200, {"experiments": found} if found else {}
        case "POST", "/apis/v2beta1/experiments":
            assert req.body is not None
            experiment = {**req.body, "experiment_id": state.new_id("experiment")}
            state.experiments[experiment["experiment_id"]] = experiment
            return 200, experiment
        case "POST", "/apis/v2beta1/runs":
            assert req.body is not None
            made = {**req.body, "run_id": state.new_id("run"), "state": "PENDING"}
            state.runs.append({**made, "created_at": _now()})
            return 200, made
        case "GET", "/apis/v2beta1/runs":
            listed = [r for r in state.runs if q.get("experiment_id") in (None, r["experiment_id"])]
            if q.get("sort_by") == "created_at desc":
                listed = listed[::-1]
            listed = listed[: int(q.get("page_size", 10))]
            return 200, {"runs": listed, "total_size": len(listed)} if listed else {}
        case "POST", "/apis/v2beta1/recurringruns":
            assert req.body is not None
            return 200, {
                **req.body,
                "recurring_run_id": state.new_id("recurring"),
                "status": "ENABLED",
            }
    return 404, {"error": f"the stand-in does not serve {method} {path}", "code": 5}


def _handler(state: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            url = urlsplit(self.path)
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            ctype = self.headers.get("Content-Type", "")
            req = Request(
                self.command,
                url.path,
                {k: v[0] for k, v in parse_qs(url.query).items()},
                {k.lower(): v for k, v in self.headers.items()},
            )
            if ctype.startswith("multipart/form-data"):
                req.files = _multipart(ctype, raw)
            elif raw:
                req.body = json.loads(raw)
            state.requests.append(req)
            status, payload = _route(state, req)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    return Handler


@contextlib.contextmanager
def serving(state: StandIn) -> Iterator[StandIn]:
    """``state`` served by a thread on a free port of 127.0.0.1 (``state.url``) until the end."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
