"""Build, store and load a retrieval index: dense (faiss) or BM25 (bm25s).

An index is a folder (local, or a prefix in the store) holding

    index.json         what it is: kind, model (URI, SHA-256, prefixes), corpus (URI, SHA-256)
    passages.parquet   id and contents of every passage, in corpus order
    dense.faiss        dense: the passages' embeddings, inner product over unit vectors
    bm25/              bm25: bm25s's arrays (saved without pickle)

``index.json`` is written last, so a folder without it is an unfinished build and is neither
loaded nor overwritten. A dense index is exact (``IndexFlatIP``) up to ``HNSW_ABOVE``
passages and HNSW above (``--index-type`` chooses either); an exact one is searched with one
matrix product per batch of queries. BM25 ranks as the envs' in-process
``SearchIndex`` does (bm25s's Lucene variant, the same tokens, ties in corpus order), so a
BM25 index of a task's passages answers exactly what the env would have found itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from trace_core.envs.retrieval import TOKEN
from trace_core.retriever.corpus import Corpus, corpus_of
from trace_core.retriever.encoder import Encoder
from trace_core.store.uri import is_remote

Kind = Literal["dense", "bm25"]
KINDS: tuple[Kind, ...] = ("dense", "bm25")
INDEX_TYPES = ("auto", "flat", "hnsw")
HNSW_ABOVE = 250_000
"""Passages above which ``--index-type auto`` builds HNSW rather than an exact index."""
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 200, 128
FORMAT = 1
MANIFEST, PASSAGES, FAISS, BM25 = "index.json", "passages.parquet", "dense.faiss", "bm25"

Hits = list[list[tuple[int, float]]]
"""Per query, (passage row, score) best first."""


class IndexUnusable(ValueError):
    """An index folder that cannot be used (unfinished, another format, another model)."""


def faiss_type(kind: Kind, index_type: str, passages: int) -> str:
    if index_type not in INDEX_TYPES:
        raise ValueError(
            f"--index-type must be one of {', '.join(INDEX_TYPES)}, got {index_type!r}"
        )
    if kind == "bm25":
        return ""
    if index_type == "auto":
        return "hnsw" if passages > HNSW_ABOVE else "flat"
    return index_type


def build_index(
    corpus: Corpus,
    output: str,
    kind: Kind,
    encoder: Encoder | None,
    index_type: str = "auto",
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """Build the index of ``corpus`` into ``output`` (a folder or store URI); its manifest.

    Refuses an ``output`` that already holds anything: a stored index is never replaced.
    """
    if kind not in KINDS:
        raise ValueError(f"--kind must be dense or bm25, got {kind!r}")
    if kind == "dense" and encoder is None:
        raise ValueError("a dense index needs an encoder (--model)")
    _refuse_existing(output)
    flavour = faiss_type(kind, index_type, len(corpus))
    with tempfile.TemporaryDirectory(prefix="trace-index-") as scratch:
        work = Path(scratch)
        _write_passages(work / PASSAGES, corpus)
        manifest: dict[str, object] = {
            "format": FORMAT,
            "kind": kind,
            "corpus": corpus.to_json(),
        }
        if kind == "dense":
            assert encoder is not None
            import faiss

            vectors = encoder.passages(list(corpus.contents), progress=progress)
            index = _faiss_index(flavour, vectors.shape[1])
            index.add(vectors)
            faiss.write_index(index, str(work / FAISS))
            manifest |= {"model": encoder.info.to_json(), "faiss": flavour}
        else:
            _bm25(list(corpus.contents), progress).save(str(work / BM25), allow_pickle=False)
        _publish(work, output, manifest)
    return manifest


def _faiss_index(flavour: str, dim: int):  # type: ignore[no-untyped-def]
    import faiss

    if flavour == "flat":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    return index


def _bm25(contents: list[str], progress: Callable[[int], None] | None = None):  # type: ignore[no-untyped-def]
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(contents, stopwords=None, show_progress=False), show_progress=False
    )
    if progress:
        progress(len(contents))
    return retriever


def _write_passages(path: Path, corpus: Corpus) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(corpus.ids), "contents": list(corpus.contents)})
    pq.write_table(table, path)


def _refuse_existing(output: str) -> None:
    if is_remote(output):
        from trace_core.store.artifacts import open_store

        if open_store(output).list_objects(""):
            raise FileExistsError(f"--output {output}: already holds objects; choose a new one")
        return
    path = Path(output.removeprefix("file://"))
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"--output {output}: already exists; choose a new folder")


def _publish(work: Path, output: str, manifest: dict[str, object]) -> None:
    """Everything, then ``index.json``: a reader never sees a half-written index."""
    text = json.dumps(manifest, indent=2) + "\n"
    if is_remote(output):
        from trace_core.store.artifacts import open_store

        store = open_store(output)
        for path in sorted(p for p in work.rglob("*") if p.is_file()):
            store.put_file(path.relative_to(work).as_posix(), path)
        store.put_bytes(MANIFEST, text.encode())
        return
    path = Path(output.removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    for item in work.iterdir():
        shutil.move(str(item), staging / item.name)
    (staging / MANIFEST).write_text(text)
    if path.exists():
        path.rmdir()  # empty (checked above)
    os.replace(staging, path)


@dataclass
class LoadedIndex:
    """An index ready to answer: ``search`` gives each query's best passage rows."""

    manifest: dict[str, object]
    ids: list[str]
    contents: list[str]
    encoder: Encoder | None
    _faiss: object = None
    _matrix: Any = None
    """An exact index's vectors (N, dim), searched by one matrix product per batch."""
    _bm25: object = None

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def model_uri(self) -> str | None:
        """The query encoder's model (a dense index's), else None."""
        model = self.manifest.get("model")
        return str(model["uri"]) if isinstance(model, dict) else None

    def search(self, queries: Sequence[str], topk: int) -> Hits:
        if not queries:
            return []
        if self.kind == "dense":
            assert self.encoder is not None
            vectors = self.encoder.queries(list(queries))
            k = min(topk, len(self.ids))
            if self._matrix is not None:  # exact: one matrix product for the whole batch
                import torch

                top = torch.topk(torch.from_numpy(vectors) @ self._matrix.T, k)
                scores, rows = top.values.numpy(), top.indices.numpy()
            else:
                scores, rows = self._faiss.search(vectors, k)  # type: ignore[attr-defined]
            return [
                [(int(r), float(s)) for r, s in zip(row, score, strict=True) if r >= 0]
                for row, score in zip(rows, scores, strict=True)
            ]
        return [self._bm25_search(q, topk) for q in queries]

    def _bm25_search(self, query: str, topk: int) -> list[tuple[int, float]]:
        vocab = self._bm25.vocab_dict  # type: ignore[attr-defined]
        tokens = [t for t in TOKEN.findall(query.lower()) if t in vocab]
        if not tokens:
            return []
        scores = np.asarray(self._bm25.get_scores(tokens), dtype=np.float64)  # type: ignore[attr-defined]
        k = min(topk, len(scores))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        # Ties in corpus order, as SearchIndex ranks them: every passage scoring the k-th best.
        cut = scores[top].min()
        rows = np.flatnonzero(scores >= cut)
        order = rows[np.argsort(-scores[rows], kind="stable")][:k]
        return [(int(r), float(scores[r])) for r in order if scores[r] > 0]


def local_index(index: str, cache: Path) -> Path:
    """The local folder of ``index``: itself, or its copy from the store in ``cache``."""
    if not is_remote(index):
        path = Path(index.removeprefix("file://"))
        if not (path / MANIFEST).is_file():
            raise IndexUnusable(
                f"--index {index}: no {MANIFEST} there (not an index, or unfinished)"
            )
        return path
    from trace_core.store.artifacts import open_store
    from trace_core.store.sync import download_folder

    target = cache / "indexes" / hashlib.sha256(index.encode()).hexdigest()[:16]
    if (target / MANIFEST).is_file():
        return target
    if not open_store(index).exists(MANIFEST):
        raise IndexUnusable(f"--index {index}: no {MANIFEST} there (not an index, or unfinished)")
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    download_folder(index, staging)
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, target)
    return target


def load_index(index: str, cache: Path, model: str | None = None) -> LoadedIndex:
    """Load ``index``; a dense one with ``model`` (default: the one it records), refused unless
    that model's files are the ones it was built with."""
    import pyarrow.parquet as pq

    folder = local_index(index, cache)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except json.JSONDecodeError as err:
        raise IndexUnusable(f"--index {index}: {MANIFEST} is not JSON ({err.msg})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexUnusable(f"--index {index}: not an index of format {FORMAT}")
    table = pq.read_table(folder / PASSAGES)
    corpus = corpus_of(index, table.column("id").to_pylist(), table.column("contents").to_pylist())
    recorded = manifest["corpus"]
    if corpus.sha256 != recorded["sha256"]:
        raise IndexUnusable(f"--index {index}: {PASSAGES} is not the corpus {MANIFEST} records")
    loaded = LoadedIndex(manifest, list(corpus.ids), list(corpus.contents), None)
    if manifest["kind"] == "dense":
        import faiss

        built = manifest["model"]
        encoder = Encoder(model or built["uri"], cache)
        if encoder.info.sha256 != built["sha256"]:
            raise IndexUnusable(
                f"--index {index} was built with model {built['uri']} (sha256 "
                f"{built['sha256'][:12]}); --model {model or built['uri']} is another "
                f"(sha256 {encoder.info.sha256[:12]}): pass the model the index was built with"
            )
        loaded.encoder = encoder
        stored = faiss.read_index(str(folder / FAISS))
        if manifest.get("faiss") == "hnsw":
            stored.hnsw.efSearch = HNSW_EF_SEARCH  # type: ignore[attr-defined]
            loaded._faiss = stored
        else:
            import torch

            # The exact index's vectors, searched with torch's GEMM and top-k (the same inner
            # products as IndexFlatIP.search, one matrix product per batch of queries).
            loaded._matrix = torch.from_numpy(stored.reconstruct_n(0, stored.ntotal))
    else:
        import bm25s

        loaded._bm25 = bm25s.BM25.load(str(folder / BM25), allow_pickle=False)
    return loaded
