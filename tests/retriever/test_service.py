"""The retrieval service end to end: an index built by ``trace-rl retriever build``, served by
``trace-rl retriever serve`` on 127.0.0.1 (one dense server for the file; the fault test starts
its own BM25 ones; all stopped by pid), queried through Search-R1's API, attacked with hostile
requests, searched by HotpotQA's envs, killed under a client, and searched by one multi-hop
training iteration.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import urllib3

from trace_core.envs.base import replay
from trace_core.envs.hotpotqa import HotpotQASuite
from trace_core.envs.multihop import MultihopSuite
from trace_core.envs.remote import RemoteSearch, RetrieverUnavailable
from trace_core.envs.retrieval import SearchIndex, render
from trace_core.retriever.bench import ServedIndex
from trace_core.retriever.corpus import from_passages, read_corpus
from trace_core.retriever.encoder import BUILTIN, model_folder
from trace_core.retriever.index import IndexUnusable, build_index, load_index

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

TRACE_RL = [sys.executable, "-m", "trace_core.cli"]


def trace_rl(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRACE_RL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("retriever")


@pytest.fixture(scope="module")
def dense(work: Path) -> Path:
    """The multihop task's passages, embedded by the installed MiniLM, built by the CLI."""
    out = work / "multihop-dense"
    run = trace_rl("retriever", "build", "--task", "multihop", "--output", str(out), cwd=work)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"wrote {out}: " in run.stdout and "(dense, flat)" in run.stdout
    return out


@pytest.fixture(scope="module")
def served(dense: Path, work: Path) -> Iterator[ServedIndex]:
    server = ServedIndex(dense, work / "cache", work / "serve.log", timeout_s=180)
    yield server
    server.stop()
    assert server.process.poll() is not None


HOTPOT = [
    {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
        "answer": "yes",
        "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
        "context": [
            ["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker."]],
            ["Scott Derrickson", ["Scott Derrickson is an American director."]],
        ],
    },
    {
        "_id": "5a8c7595554299585d9e36b6",
        "question": "What government position was held by the woman who portrayed Corliss?",
        "answer": "Chief of Protocol",
        "supporting_facts": [["Shirley Temple", 0]],
        "context": [
            ["Kiss and Tell (1945 film)", ["Kiss and Tell stars Shirley Temple as Corliss."]],
            ["Shirley Temple", ["Shirley Temple served as Chief of Protocol of the US."]],
        ],
    },
]


@pytest.fixture(scope="module")
def hotpot(work: Path) -> tuple[Path, Path]:
    """A HotpotQA file and the BM25 index of its paragraphs, built by the CLI's loader option."""
    data, out = work / "hotpot_dev.json", work / "hotpot-bm25"
    data.write_text(json.dumps(HOTPOT))
    build = f"retriever build --task hotpotqa --data {data} --kind bm25 --output {out}"
    run = trace_rl(*build.split(), cwd=work)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"wrote {out}: 4 passages (bm25)" in run.stdout
    return data, out


def post(url: str, body: bytes, **headers: str) -> urllib3.BaseHTTPResponse:
    return urllib3.request("POST", f"{url}/retrieve", body=body, headers=headers, timeout=30.0)


def test_search_r1_api_answers_what_the_index_finds(served: ServedIndex, dense: Path) -> None:
    # /health said 503 while the index loaded (the port opens first), then 200.
    assert served.statuses[-1] == 200 and 503 in served.statuses
    suite = MultihopSuite(seed=0)
    queries = [t.prompt for t in suite.tasks("eval")[:5]]
    index = load_index(str(dense), dense.parent / "cache")
    local = index.search(queries, 3)
    reply = post(
        served.url, json.dumps({"queries": queries, "topk": 3, "return_scores": True}).encode()
    )
    assert reply.status == 200
    result = reply.json()["result"]
    assert len(result) == len(queries)
    rows = {pid: row for row, pid in enumerate(index.ids)}
    for hits, expected in zip(result, local, strict=True):
        assert [set(h) for h in hits] == [{"document", "score"}] * 3
        assert [set(h["document"]) for h in hits] == [{"id", "contents"}] * 3
        assert [rows[h["document"]["id"]] for h in hits] == [r for r, _ in expected]
        assert [h["score"] for h in hits] == pytest.approx([s for _, s in expected], abs=1e-5)
    # Without return_scores each hit is the document itself; topk defaults to 3.
    bare = post(served.url, json.dumps({"queries": queries[:1]}).encode()).json()["result"]
    assert bare == [[h["document"] for h in result[0]]]
    # The envs' client renders the same documents as observation lines.
    client = RemoteSearch(served.url)
    assert client.search(queries[0], 2) == [
        render(h["document"]["contents"]) for h in result[0][:2]
    ]


HOSTILE = [
    (b"not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"queries": "one"}', 400, "'queries' must be a non-empty list"),
    (b'{"queries": []}', 400, "'queries' must be a non-empty list"),
    (b'{"queries": [1]}', 400, "'queries'[0] must be a string"),
    (b'{"queries": ["a"], "topk": 1000000000}', 400, "'topk' must be an integer in [1, 100]"),
    (b'{"queries": ["a"], "topk": "3"}', 400, "'topk'"),
    (b'{"queries": ["a"], "return_scores": "yes"}', 400, "'return_scores'"),
    (b'{"queries": ["a"], "path": "/etc/passwd"}', 400, "unknown field 'path'"),
    (json.dumps({"queries": ["x"] * 10_000}).encode(), 413, "10000 queries; the limit is 256"),
    (json.dumps({"queries": ["q" * 2_000_000]}).encode(), 413, "over 1048576 bytes"),
    (json.dumps({"queries": ["q" * 5_000]}).encode(), 413, "5000 characters; the limit is 2000"),
]


def test_hostile_requests_get_a_4xx_and_the_server_goes_on(served: ServedIndex) -> None:
    for body, status, detail in HOSTILE:
        reply = post(served.url, body)
        assert reply.status == status, (body[:60], reply.data[:200])
        assert detail in reply.json()["detail"], (body[:60], reply.json())
        assert "\n" not in reply.json()["detail"]
    # A body sent in chunks, no length declared, is cut off at the limit too.
    chunks = (b'{"queries": ["' + b"q" * 65_536 for _ in range(20))
    reply = urllib3.request("POST", f"{served.url}/retrieve", body=chunks, timeout=30.0)
    assert reply.status == 413
    assert urllib3.request("GET", f"{served.url}/retrieve").status == 405
    assert urllib3.request("GET", f"{served.url}/etc/passwd").status == 404
    assert served.process.poll() is None
    assert served.health()["status"] == "ok"
    assert post(served.url, b'{"queries": ["kara city"], "topk": 1}').status == 200


def test_a_dense_index_refuses_another_model(dense: Path, tmp_path: Path) -> None:
    other = tmp_path / "minilm-edited"
    shutil.copytree(model_folder(BUILTIN, tmp_path), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    with pytest.raises(IndexUnusable, match=r"was built with model minilm .* is another"):
        load_index(str(dense), tmp_path, model=str(other))
    # Served with it, the server stops with status 1 and says why in one line.
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match=r"the retriever exited \(1\)"):
        ServedIndex(dense, tmp_path, log, timeout_s=180, more=("--model", str(other)))
    said = [line for line in log.read_text().splitlines() if "did not load" in line]
    assert len(said) == 1 and "IndexUnusable" in said[0] and "is another" in said[0], said


def test_an_hnsw_index_finds_what_the_exact_one_finds(dense: Path, tmp_path: Path) -> None:
    from trace_core.retriever.encoder import Encoder

    suite = MultihopSuite(seed=0)
    corpus = from_passages("multihop", suite.corpus())
    manifest = build_index(
        corpus, str(tmp_path / "hnsw"), "dense", Encoder(BUILTIN, tmp_path), "hnsw"
    )
    assert manifest["faiss"] == "hnsw"
    queries = [t.prompt for t in suite.tasks("eval")[:20]]
    exact = load_index(str(dense), tmp_path).search(queries, 3)
    graph = load_index(str(tmp_path / "hnsw"), tmp_path).search(queries, 3)
    assert [[r for r, _ in row] for row in graph] == [[r for r, _ in row] for row in exact]


def test_corpora_in_either_format_are_the_same_and_bad_rows_are_named(tmp_path: Path) -> None:
    passages = MultihopSuite(seed=0).corpus()[:50]
    parquet, jsonl = tmp_path / "c.parquet", tmp_path / "c.jsonl"
    columns = {"id": [p.id for p in passages], "title": [p.title for p in passages]}
    pq.write_table(pa.table({**columns, "text": [p.text for p in passages]}), parquet)
    jsonl.write_text(
        "".join(json.dumps({"id": p.id, "contents": p.contents}) + "\n" for p in passages)
    )
    a, b = read_corpus(str(parquet), tmp_path), read_corpus(str(jsonl), tmp_path)
    assert a.sha256 == b.sha256 == from_passages("x", passages).sha256
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "one"}\n{"id": "a", "contents": "two"}\n')
    with pytest.raises(ValueError, match="row 1 repeats id 'a' \\(first at row 0\\)"):
        read_corpus(str(bad), tmp_path)
    bad.write_text('{"id": "a", "contents": "one"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="line 2 field 'contents' is missing"):
        read_corpus(str(bad), tmp_path)
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), parquet)
    with pytest.raises(ValueError, match="no column 'text'"):
        read_corpus(str(parquet), tmp_path)
    with pytest.raises(ValueError, match=r"expected a \.parquet file"):
        read_corpus(str(tmp_path / "c.csv"), tmp_path)
    # A built index is never replaced.
    out = tmp_path / "bm25"
    build_index(b, str(out), "bm25", None)
    with pytest.raises(FileExistsError, match="already exists"):
        build_index(b, str(out), "bm25", None)


def test_bm25_of_a_tasks_corpus_finds_what_the_env_finds_in_process(tmp_path: Path) -> None:
    suite = MultihopSuite(seed=0)
    build_index(from_passages("multihop", suite.corpus()), str(tmp_path / "i"), "bm25", None)
    index = load_index(str(tmp_path / "i"), tmp_path)
    queries = [turn[7:-1] for t in suite.tasks("eval")[:40] for turn in t.reference[:-1]]
    queries += ["the capital of", "zzz unknown", "bo"]
    found = index.search(queries, 2)
    for query, hits in zip(queries, found, strict=True):
        assert [render(index.contents[r]) for r, _ in hits] == suite.index.search(query, 2)
    assert isinstance(suite.index, SearchIndex)


def test_an_index_in_the_store_is_loaded_from_it(s3_env: dict[str, str], tmp_path: Path) -> None:
    corpus = from_passages("multihop", MultihopSuite(seed=0).corpus())
    build_index(corpus, "s3://trace/indexes/multihop-bm25", "bm25", None)
    index = load_index("s3://trace/indexes/multihop-bm25", tmp_path)
    assert index.ids == list(corpus.ids) and index.kind == "bm25"
    # Served from the store as the Deployment serves it: downloaded into the cache, then loaded.
    uri = "s3://trace/indexes/multihop-bm25"
    server = ServedIndex(uri, tmp_path / "cache", tmp_path / "serve.log", timeout_s=180)
    try:
        assert RemoteSearch(server.url).search("kara city", 2) == [
            render(index.contents[r]) for r, _ in index.search(["kara city"], 2)[0]
        ]
    finally:
        server.stop()
    assert any((tmp_path / "cache" / "indexes").rglob("index.json"))
    with pytest.raises(FileExistsError, match="already holds objects"):
        build_index(corpus, "s3://trace/indexes/multihop-bm25", "bm25", None)
    with pytest.raises(IndexUnusable, match=r"no index\.json there"):
        load_index("s3://trace/indexes/nothing-here", tmp_path)


def test_a_killed_server_is_waited_for_and_a_dead_one_fails_in_one_line(
    hotpot: tuple[Path, Path], work: Path, tmp_path: Path
) -> None:
    """HotpotQA's questions searching the service: its envs see the paragraphs the in-process
    index shows; a server killed under a client is waited for; one that stays down fails the
    call in one line naming it."""
    data, index = hotpot
    first = ServedIndex(index, work / "cache", tmp_path / "a.log", timeout_s=180)
    suite = HotpotQASuite(str(data), retriever_url=first.url)
    task = suite.data.tasks[0]
    observations, last = replay(suite.make_env(), task, task.reference)
    assert last is not None and last.reward == 1.0
    assert observations[1].startswith("Scott Derrickson: Scott Derrickson is an American")
    client = RemoteSearch(first.url, retries=8, backoff_s=0.25, timeout_s=5.0)
    answers: list[list[str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def search() -> None:
        while not stop.is_set():
            try:
                answers.append(client.search("Shirley Temple", 2))
            except BaseException as err:
                errors.append(err)
                return

    worker = threading.Thread(target=search, daemon=True)
    worker.start()
    while not answers:
        time.sleep(0.05)
    first.process.kill()  # mid-stream: the client retries while it is down
    first.stop()
    before = len(answers)
    second = ServedIndex(index, work / "cache", tmp_path / "b.log", timeout_s=180, port=first.port)
    try:
        deadline = time.monotonic() + 60
        while len(answers) < before + 5 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        worker.join(60)
        assert not errors, errors
        assert len(answers) >= before + 5 and all(a == answers[0] for a in answers)
        assert answers[0][0].startswith("Shirley Temple: ")
    finally:
        second.stop()
    dead = RemoteSearch(second.url, retries=2, backoff_s=0.05, timeout_s=1.0)
    with pytest.raises(RetrieverUnavailable) as caught:
        dead.search("Shirley Temple", 2)
    assert second.url in str(caught.value) and "\n" not in str(caught.value)


def test_one_multihop_iteration_trains_against_the_served_index(
    served: ServedIndex, work: Path
) -> None:
    """40 SFT steps: enough for the tiny policy to search (10 searches at seed 0)."""
    before = int(served.health()["queries"])
    out = work / "train"
    small = "--warmstart-steps 40 --iterations 1 --budget 4 --prompts 8 --eval-tasks 2"
    small += " --eval-k 1 --eval-every 1 --threads 1 --max-tokens 16"
    command = f"train --task multihop --retriever-url {served.url} --output {out} {small}"
    run = trace_rl(*command.split(), cwd=work, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [0, 1]
    assert lines[1]["rollout"]["dropped_prompts"] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["retriever_url"] == served.url
    assert int(served.health()["queries"]) > before  # its searches went to the service


def test_bench_retriever_prints_each_level_against_one_client(work: Path) -> None:
    """`trace-rl bench retriever`, small: its levels, their ratios to one client's serial
    queries, and recall for both kinds, in its table and its JSON."""
    out = work / "bench.json"
    small = "--passages 1000 --seconds 0.5 --clients 1,4"
    run = trace_rl(
        *f"bench retriever {small} --index-dir {work / 'bench'} --json {out}".split(), cwd=work
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [level["clients"] for level in data["levels"]] == [1, 4]
    assert data["levels"][0]["vs_serial"] == 1.0 and data["passages"] == 1000
    assert all(level["errors"] == 0 and level["requests"] > 0 for level in data["levels"])
    assert set(data["recall"]) == {"questions", "hop_queries", "dense", "bm25"}
    assert data["recall"]["bm25"]["hop@1"] == 1.0  # each hop's search finds its passage
    assert "vs 1 client" in run.stdout and "1.00×" in run.stdout
