"""The retrieval service's client: Search-R1's passages rendered as the in-process index shows
them, the URL checked up front, retries ending in one line, and an unreachable service dropping
the prompt rather than the rollout. Against a stand-in on 127.0.0.1 (the real service:
tests/retriever)."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_core.algo.plan import Budget
from trace_core.envs.base import Task
from trace_core.envs.multihop import MultihopEnv, MultihopSuite
from trace_core.envs.remote import RemoteSearch, RetrieverUnavailable, check_retriever_url
from trace_core.envs.retrieval import Passage, render
from trace_core.envs.suites import make_suite
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor


def fast(url: str) -> RemoteSearch:
    """Two quick attempts: what the tests give a service that may not be there."""
    return RemoteSearch(url, retries=1, backoff_s=0.01, timeout_s=0.5)


def closed_port_url() -> str:
    """A URL nothing listens on: a port bound, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- passages ----------------------------------------------------------------------------------
def test_contents_and_render_worked_examples() -> None:
    titled = Passage("Ed Wood", "Ed Wood", "Edward Davis Wood Jr. was an American filmmaker.")
    assert titled.contents == '"Ed Wood"\nEdward Davis Wood Jr. was an American filmmaker.'
    assert render(titled.contents) == "Ed Wood: Edward Davis Wood Jr. was an American filmmaker."
    plain = Passage("multihop-0-000000", "", "bo lin was born in kara .")
    assert plain.contents == render(plain.contents) == "bo lin was born in kara ."
    assert render("two\nlines") == "two lines"  # one passage per observation line
    assert render('"T"\nfirst\nsecond') == "T: first second"
    assert render('"Weird Al" Yankovic"\ntext') == 'Weird Al" Yankovic: text'
    with pytest.raises(ValueError, match="line break"):
        Passage("x", "a\nb", "text")


_LINE = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=40)


@given(title=_LINE, text=_LINE)
def test_render_inverts_contents(title: str, text: str) -> None:
    """A HotpotQA paragraph exported as Passage(title, sentences) renders back to the
    in-process passage, "title: sentences"; a passage without a title to its text."""
    rendered = render(Passage("p", title, text).contents)
    assert rendered == (f"{title}: {text}" if title else text)


# --- the URL and the object ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "",
        "retriever:8000",
        "ftp://host",
        "http://",
        "http://host:port",
        "http://h:0",
        "http://host/x?q=1",
        "http://a b:8000",
    ],
)
def test_a_bad_url_is_refused_naming_retriever_url(url: str) -> None:
    with pytest.raises(ValueError, match=r"^retriever_url .*http\(s\)://HOST\[:PORT\]"):
        RemoteSearch(url)


def test_a_good_url_loses_its_trailing_slash() -> None:
    assert check_retriever_url("http://trace-retriever:8000/") == "http://trace-retriever:8000"
    assert RemoteSearch("https://search.example.com/api/").url == "https://search.example.com/api"


def test_remote_search_pickles_without_its_pool() -> None:
    search = fast("http://127.0.0.1:9")
    search._pool_manager()  # made: it stays behind
    copy = pickle.loads(pickle.dumps(search))
    assert (copy.url, copy.retries, copy.timeout_s, copy._pool) == (search.url, 1, 0.5, None)
    assert copy._pool_manager() is copy._pool_manager()  # made again once, on first use


# --- answers -------------------------------------------------------------------------------------
class StandIn(BaseHTTPRequestHandler):
    """Search-R1's /retrieve: ``script`` holds the (status, body) of the next answers; when it
    runs out, every query finds one titled passage named after itself."""

    script: ClassVar[list[tuple[int, object]]] = []
    bodies: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append(body)
        status, answer = StandIn.script.pop(0) if StandIn.script else (200, None)
        if answer is None:
            answer = {
                "result": [
                    [{"document": {"id": q, "contents": f'"{q}"\nabout {q}'}, "score": 1.0}]
                    * body["topk"]
                    for q in body["queries"]
                ]
            }
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    StandIn.script, StandIn.bodies = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_search_renders_the_service_passages_best_first(stand_in: str) -> None:
    search = fast(stand_in)
    assert search.search("Ed Wood", 2) == ["Ed Wood: about Ed Wood"] * 2
    assert StandIn.bodies == [{"queries": ["Ed Wood"], "topk": 2, "return_scores": True}]
    raw = search.retrieve(["a", "b"], 1)
    assert raw == [
        [{"document": {"id": q, "contents": f'"{q}"\nabout {q}'}, "score": 1.0}] for q in "ab"
    ]
    search.search("x" * 5000, 1)  # an agent's overlong query is cut, not refused
    assert StandIn.bodies[-1]["queries"] == ["x" * search.max_query_chars]


def test_a_5xx_is_tried_again_and_a_4xx_is_not(stand_in: str) -> None:
    search = fast(stand_in)
    StandIn.script = [(503, {"detail": "the index is still loading"})]
    assert search.search("q", 1) == ["q: about q"]
    assert len(StandIn.bodies) == 2
    StandIn.script = [(413, {"detail": "'queries'[0] is 5000 characters; the limit is 2000"})]
    with pytest.raises(ValueError, match=r"/retrieve: HTTP 413: 'queries'\[0\] is 5000 char"):
        search.search("q", 1)
    assert len(StandIn.bodies) == 3
    StandIn.script = [(503, {"detail": "loading"})] * 2
    with pytest.raises(RetrieverUnavailable, match=r"after 2 attempts \(last: HTTP 503: loading"):
        search.search("q", 1)


@pytest.mark.parametrize(
    "answer",
    [[], {"result": []}, {"result": [{"id": "a"}]}, {"result": [[{"document": {"id": "a"}}]]}],
)
def test_an_answer_not_in_search_r1_shape_is_named(stand_in: str, answer: object) -> None:
    StandIn.script = [(200, answer)]
    with pytest.raises(ValueError, match=r"/retrieve: the answer is not Search-R1's"):
        fast(stand_in).search("q", 1)


def test_items_without_scores_are_read_too(stand_in: str) -> None:
    StandIn.script = [(200, {"result": [[{"id": "a", "contents": '"A"\ntext'}]]})]
    assert fast(stand_in).search("q", 3) == ["A: text"]


def test_an_unreachable_service_is_one_line_naming_it() -> None:
    url = closed_port_url()
    started = time.monotonic()
    with pytest.raises(RetrieverUnavailable) as caught:
        fast(url).search("bo lin born", 2)
    message = str(caught.value)
    assert message.startswith(f"retriever {url}: no answer after 2 attempts (last: ")
    assert "\n" not in message and len(message) < 400
    assert time.monotonic() - started < 5


# --- the env and the rollout ---------------------------------------------------------------------
TASK = Task("t", "where was bo lin born ?", "kara", "hops=1", "train")


class Unreachable:
    deadline_s = 1.0

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def search(self, query: str, k: int) -> list[str]:
        self.threads.append(threading.current_thread())
        raise RetrieverUnavailable("retriever http://x:1: no answer after 5 attempts")


def test_a_step_whose_search_is_unavailable_raises() -> None:
    """Not an observation: the rollout drops the prompt (``rollout.grow``). A searcher that
    bounds itself (``deadline_s``) is called as it is, not in the tools' bounded thread."""
    index = Unreachable()
    env = MultihopEnv(lambda task: index)
    env.reset(TASK)
    with pytest.raises(RetrieverUnavailable, match="no answer after 5 attempts"):
        env.step("search[bo lin born]")
    assert index.threads == [threading.current_thread()]
    del Unreachable.deadline_s  # an index without its own bound: the same, through the thread
    try:
        env.reset(TASK)
        with pytest.raises(RetrieverUnavailable):
            env.step("search[bo lin born]")
        assert index.threads[-1] is not threading.current_thread()
    finally:
        Unreachable.deadline_s = 1.0


def test_make_suite_takes_retriever_url_for_the_search_tasks_only() -> None:
    suite = make_suite("multihop", retriever_url="http://retriever:8000")
    assert isinstance(suite, MultihopSuite) and isinstance(suite.searcher, RemoteSearch)
    local = make_suite("multihop", retriever_url="")
    assert isinstance(local, MultihopSuite) and local.searcher is local.index  # in process
    with pytest.raises(ValueError, match=r"^retriever_url 'http://r:1': task 'calc' searches no"):
        make_suite("calc", retriever_url="http://r:1")
    with pytest.raises(ValueError, match=r"^retriever_url 'r:1'"):
        make_suite("multihop", retriever_url="r:1")


class ReferenceEngine:
    """Plays each task's reference turns."""

    def __init__(self, fmt: TurnFormat, tasks: list[Task]) -> None:
        self.fmt, self.stats = fmt, EngineStats()
        self.by_prompt = {tuple(fmt.prompt_ids(t.prompt)): t for t in tasks}

    def generate(self, prompts, params, seed=None):  # type: ignore[no-untyped-def]
        out = []
        for prompt in prompts:
            task = next(t for h, t in self.by_prompt.items() if tuple(prompt[: len(h)]) == h)
            turn = list(prompt).count(self.fmt.end_of_turn_id) - 1
            ids = np.asarray(self.fmt.action_ids(task.reference[turn]), dtype=np.int32)
            out.append([Completion(ids, np.zeros(len(ids), np.float32), True)] * params.n)
        return out


def test_a_rollout_on_an_unreachable_service_drops_its_prompts_not_the_run() -> None:
    suite = MultihopSuite(seed=0, entities=30, train_size=6, eval_size=0)
    suite.searcher = fast(closed_port_url())
    fmt = TurnFormat(build_word_tokenizer(suite.vocabulary()))  # no search: in process
    tasks = suite.tasks("train")
    config = GrowConfig("trace", Budget(12, 2, 4), SamplingParams(max_tokens=24), seed=0)
    dropped: list[tuple[str, str]] = []
    engine = ReferenceEngine(fmt, tasks)
    trees = grow_trees(
        engine, fmt, suite.make_env, tasks, ConstantPredictor(), config, dropped=dropped
    )
    assert trees == []
    assert dropped and {task for task, _ in dropped} <= {t.id for t in tasks}
    for _, error in dropped:
        assert error.startswith("RetrieverUnavailable: retriever http://127.0.0.1:")
        assert "no answer after 2 attempts" in error and "\n" not in error
