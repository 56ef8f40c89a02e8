"""BM25 search over a fixed list of passages: the search tool of the multihop env.

bm25s's Lucene variant, queries tokenised exactly as the passages were; equal scores rank in
passage order, so results are deterministic. The synthetic multihop suite indexes its whole
world once; HotpotQA builds one small index per question.

A retrieval service (``envs.remote``) holds ``Passage``s in Search-R1's corpus layout, whose
``contents`` is ``"Title"`` on a line of its own, then the text; ``render`` turns that back into
the observation line the in-process index would show ("Title: text").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import bm25s
import numpy as np

TOKEN = re.compile(r"(?u)\b\w\w+\b")
"""bm25s's default token pattern, so that queries split exactly as the passages were (the
retrieval service's BM25 index splits with it too)."""


class Searcher(Protocol):
    """What the multihop env searches: the in-process ``SearchIndex`` or ``RemoteSearch``."""

    def search(self, query: str, k: int) -> list[str]:
        """The ``k`` best passages for ``query`` as observation lines, best first."""
        ...


@dataclass(frozen=True)
class Passage:
    """One passage of a retrieval corpus: a stable id, a title ("" for none) and its text."""

    id: str
    title: str
    text: str

    def __post_init__(self) -> None:
        if "\n" in self.title:
            raise ValueError(f"passage {self.id!r}: its title holds a line break")

    @property
    def contents(self) -> str:
        """Search-R1's ``contents``: ``"Title"``, a line break, the text; the text alone
        without a title."""
        return f'"{self.title}"\n{self.text}' if self.title else self.text


def render(contents: str) -> str:
    """A passage's ``contents`` as one observation line: a first line ``"Title"`` and the text
    after it become ``Title: text`` (HotpotQA's in-process passages read the same); anything
    else is the contents as they are. Line breaks in the text become spaces."""
    first, newline, rest = contents.partition("\n")
    if newline and len(first) >= 2 and first[0] == first[-1] == '"':
        return f"{first[1:-1]}: {_one_line(rest)}"
    return _one_line(contents)


def _one_line(text: str) -> str:
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


class SearchIndex:
    """BM25 (bm25s, Lucene variant) over passages; equal scores rank in passage order."""

    def __init__(self, passages: Sequence[str]) -> None:
        if not passages:
            raise ValueError("a search index needs at least one passage")
        self.passages = tuple(passages)
        self._retriever: bm25s.BM25 | None = None
        # bm25s cannot index a corpus without a single word; such an index finds nothing.
        if any(TOKEN.search(p.lower()) for p in self.passages):
            self._retriever = bm25s.BM25()
            self._retriever.index(
                bm25s.tokenize(list(self.passages), stopwords=None, show_progress=False),
                show_progress=False,
            )

    def search(self, query: str, k: int) -> list[str]:
        """The ``k`` best passages that share a word with ``query`` (fewer if fewer do)."""
        if self._retriever is None:
            return []
        tokens = [t for t in TOKEN.findall(query.lower()) if t in self._retriever.vocab_dict]
        if not tokens:
            return []
        scores = np.asarray(self._retriever.get_scores(tokens), dtype=np.float64)
        order = np.argsort(-scores, kind="stable")[:k]  # stable: ties keep passage order
        return [self.passages[i] for i in order if scores[i] > 0]
