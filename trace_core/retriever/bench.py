"""``trace-rl bench retriever``: the retrieval server's throughput and latency, and recall.

    trace-rl bench retriever --json build/bench/retriever.json

Throughput: a dense index (the installed MiniLM, exact faiss) of ``passages`` passages from
multihop worlds (seeds 1, 2, ...) is built once into ``--index-dir`` (reused while its corpus
and model are the same) and served by ``trace-rl retriever serve`` in its own process. Then
``c`` clients (threads, one keep-alive connection each) send one query per request for
``seconds`` seconds, for each ``c`` of ``clients``; each level's queries per second are
divided by those of one client sending its queries one at a time, the baseline, measured in
the same command. Latency is per request, as the client sees it.

Recall: the built-in multihop task's questions (eval split) over a corpus of all its passages,
dense (the same model) against BM25, both in-process: recall@k is the share of a question's
gold passages (one per hop) among its k best, and first-hop@k whether the first hop's passage
(the only one a question names) is among them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trace_core.envs.multihop import MultihopSuite, draw_world
from trace_core.envs.retrieval import Passage
from trace_core.retriever.corpus import Corpus, from_passages
from trace_core.retriever.encoder import BUILTIN, Encoder
from trace_core.retriever.index import build_index, load_index

PEOPLE = 3000  # the largest world; about 15,000 passages each


@dataclass(frozen=True)
class RetrieverBenchConfig:
    passages: int = 100_000
    clients: tuple[int, ...] = (1, 16, 64)
    seconds: float = 10.0
    topk: int = 3
    recall_k: tuple[int, ...] = (1, 3, 10)
    index_dir: Path = Path("build/bench/retriever")
    threads: int = 0
    """The server's encoder threads (0: torch's default)."""
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.passages < 1 or self.seconds <= 0 or self.topk < 1:
            raise ValueError("--passages, --seconds and --topk must be positive")
        if not self.clients or min(self.clients) < 1 or 1 not in self.clients:
            raise ValueError(f"--clients must be positive and include 1, got {self.clients}")
        if not self.recall_k or min(self.recall_k) < 1:
            raise ValueError(f"--recall-k must be positive, got {self.recall_k}")


def bench_corpus(passages: int) -> Corpus:
    """``passages`` passages of multihop worlds, seeds 1, 2, ... in order."""
    rows: list[Passage] = []
    seed = 1
    while len(rows) < passages:
        world = draw_world(np.random.default_rng([seed, 0]), PEOPLE)
        rows += [Passage(f"w{seed}-{i:06d}", "", text) for i, text in enumerate(world.passages())]
        seed += 1
    return from_passages(f"bench:multihop-worlds:{passages}", rows[:passages])


def _index_for(
    corpus: Corpus, folder: Path, say: Callable[[str], None]
) -> tuple[Path, float | None]:
    """The dense index of ``corpus`` in ``folder`` and the seconds its build took: reused (None)
    if it is that corpus's, else built."""
    import json

    path = folder / f"dense-{len(corpus)}-{corpus.sha256[:12]}"
    manifest = path / "index.json"
    if manifest.is_file() and json.loads(manifest.read_text())["corpus"]["sha256"] == corpus.sha256:
        say(f"reusing the index at {path}")
        return path, None
    shutil.rmtree(path, ignore_errors=True)  # an unfinished build of this same corpus
    say(f"building a dense index of {len(corpus):,} passages into {path} (once)")
    encoder = Encoder(BUILTIN, folder / "cache")
    start = time.perf_counter()
    build_index(corpus, str(path), "dense", encoder)
    seconds = time.perf_counter() - start
    say(f"built in {seconds:.0f} s")
    return path, seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedIndex:
    """``trace-rl retriever serve`` in its own process on 127.0.0.1; stopped by pid."""

    def __init__(
        self,
        index: Path | str,
        cache: Path,
        log: Path,
        threads: int = 0,
        timeout_s: float = 600.0,
        port: int = 0,
        more: tuple[str, ...] = (),
    ) -> None:
        """``more``: further flags of ``trace-rl retriever serve``."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.statuses: list[int] = []
        """The /health statuses seen while waiting for it to be ready, in order."""
        command = [sys.executable, "-m", "trace_core.cli", "retriever", "serve"]
        command += ["--index", str(index), "--port", str(self.port), "--cache-dir", str(cache)]
        command += ["--threads", str(threads), *more]
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s, log)

    def _wait_ready(self, timeout_s: float, log: Path) -> None:
        import urllib3

        deadline = time.monotonic() + timeout_s
        http = urllib3.PoolManager(retries=False, timeout=2.0)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the retriever exited ({self.process.returncode}); see {log}")
            try:
                self.statuses.append(http.request("GET", f"{self.url}/health").status)
                if self.statuses[-1] == 200:
                    return
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the retriever was not ready within {timeout_s:.0f} s; see {log}")

    def health(self) -> dict[str, object]:
        import json

        import urllib3

        return json.loads(urllib3.request("GET", f"{self.url}/health", timeout=5.0).data)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def load_level(url: str, queries: list[str], clients: int, seconds: float, topk: int) -> dict:
    """``clients`` threads sending one query per request for ``seconds``; their figures."""
    import json

    import urllib3

    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    start_line = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def client(c: int) -> None:
        pool = urllib3.connection_from_url(url, maxsize=1, retries=False, timeout=30.0)
        i = c
        start_line.wait(60)
        while time.perf_counter() < stop_at[0]:
            body = json.dumps({"queries": [queries[i % len(queries)]], "topk": topk})
            began = time.perf_counter()
            try:
                ok = pool.request("POST", "/retrieve", body=body).status == 200
            except urllib3.exceptions.HTTPError:
                ok = False
            if ok:
                latencies[c].append(time.perf_counter() - began)
            else:
                errors[c] += 1
            i += clients

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    began = time.perf_counter()
    stop_at[0] = began + seconds
    start_line.wait(60)
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    every = np.asarray([x for row in latencies for x in row]) * 1000.0
    return {
        "clients": clients,
        "requests": int(every.size),
        "errors": int(sum(errors)),
        "seconds": elapsed,
        "qps": every.size / elapsed,
        "p50_ms": float(np.percentile(every, 50)) if every.size else float("nan"),
        "p99_ms": float(np.percentile(every, 99)) if every.size else float("nan"),
    }


def multihop_recall(ks: tuple[int, ...], cache: Path) -> dict[str, object]:
    """Recall of the multihop task's gold passages (eval split), dense and BM25: with the
    question as the query (recall@k, first_hop@k), and with each hop's reference search
    (``bo lin born``: hop@k, whether that hop's passage is among the k best)."""
    suite = MultihopSuite(seed=0)
    corpus = from_passages("task:multihop:seed=0", suite.corpus())
    row_of = {text: row for row, text in enumerate(corpus.contents)}
    questions, golds, hop_queries, hop_golds = [], [], [], []
    for task in suite.tasks("eval"):
        chain = suite.chain_of(task)
        path = suite.world.follow(chain.start, chain.relations)
        gold = [
            row_of[suite.world.passage(s, r)] for s, r in zip(path, chain.relations, strict=False)
        ]
        questions.append(task.prompt)
        golds.append(gold)
        searches = [turn[len("search[") : -1] for turn in task.reference[:-1]]
        hop_queries += searches
        hop_golds += gold[: len(searches)]
    out: dict[str, object] = {"questions": len(questions), "hop_queries": len(hop_queries)}
    with tempfile.TemporaryDirectory(prefix="trace-recall-") as scratch:
        for kind in ("dense", "bm25"):
            folder = Path(scratch) / kind
            encoder = Encoder(BUILTIN, cache) if kind == "dense" else None
            build_index(corpus, str(folder), kind, encoder)  # type: ignore[arg-type]
            index = load_index(str(folder), cache)
            hits = index.search(questions, max(ks))
            by_hop = index.search(hop_queries, max(ks))
            figures: dict[str, float] = {}
            for k in ks:
                found = [{r for r, _ in row[:k]} for row in hits]
                pairs = list(zip(found, golds, strict=True))
                figures[f"recall@{k}"] = float(
                    np.mean([len(f & set(g)) / len(g) for f, g in pairs])
                )
                figures[f"first_hop@{k}"] = float(np.mean([g[0] in f for f, g in pairs]))
                figures[f"hop@{k}"] = float(
                    np.mean(
                        [
                            g in {r for r, _ in row[:k]}
                            for row, g in zip(by_hop, hop_golds, strict=True)
                        ]
                    )
                )
            out[kind] = figures
    return out


def run_retriever_bench(
    config: RetrieverBenchConfig, say: Callable[[str], None] = print
) -> dict[str, object]:
    config.index_dir.mkdir(parents=True, exist_ok=True)
    cache = config.index_dir / "cache"
    corpus = bench_corpus(config.passages)
    index, build_seconds = _index_for(corpus, config.index_dir, say)
    queries = [task.prompt for task in MultihopSuite(seed=0).tasks("train")]
    server = ServedIndex(
        index, cache, config.index_dir / "serve.log", config.threads, config.ready_timeout_s
    )
    levels = []
    try:
        load_level(server.url, queries, 1, min(1.0, config.seconds), config.topk)  # warm-up
        for clients in sorted(config.clients):
            say(f"{clients} client(s) for {config.seconds:g} s")
            before = server.health()
            level = load_level(server.url, queries, clients, config.seconds, config.topk)
            after = server.health()
            batches = int(after["batches"]) - int(before["batches"])  # type: ignore[call-overload]
            searched = int(after["queries"]) - int(before["queries"])  # type: ignore[call-overload]
            level["mean_batch"] = searched / batches if batches else 0.0
            levels.append(level)
    finally:
        server.stop()
    serial = next(level for level in levels if level["clients"] == 1)["qps"]
    for level in levels:
        level["vs_serial"] = level["qps"] / serial if serial else float("nan")
    say("recall on the multihop task's questions, dense and BM25")
    return {
        "passages": len(corpus),
        "corpus_sha256": corpus.sha256,
        "model": BUILTIN,
        "faiss": "flat",
        "build_seconds": build_seconds,
        "topk": config.topk,
        "seconds_per_level": config.seconds,
        "cpus": os.cpu_count(),
        "levels": levels,
        "recall": multihop_recall(config.recall_k, cache),
    }
