"""BM25 search over a fixed list of passages: the search tool of the multihop env.

bm25s's Lucene variant, queries tokenised exactly as the passages were; equal scores rank in
passage order, so results are deterministic. The synthetic multihop suite indexes its whole
world once; HotpotQA builds one small index per question.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import bm25s
import numpy as np

# bm25s's default token pattern, so that queries split exactly as the passages were.
_TOKEN = re.compile(r"(?u)\b\w\w+\b")


class SearchIndex:
    """BM25 (bm25s, Lucene variant) over passages; equal scores rank in passage order."""

    def __init__(self, passages: Sequence[str]) -> None:
        if not passages:
            raise ValueError("a search index needs at least one passage")
        self.passages = tuple(passages)
        self._retriever: bm25s.BM25 | None = None
        # bm25s cannot index a corpus without a single word; such an index finds nothing.
        if any(_TOKEN.search(p.lower()) for p in self.passages):
            self._retriever = bm25s.BM25()
            self._retriever.index(
                bm25s.tokenize(list(self.passages), stopwords=None, show_progress=False),
                show_progress=False,
            )

    def search(self, query: str, k: int) -> list[str]:
        """The ``k`` best passages that share a word with ``query`` (fewer if fewer do)."""
        if self._retriever is None:
            return []
        tokens = [t for t in _TOKEN.findall(query.lower()) if t in self._retriever.vocab_dict]
        if not tokens:
            return []
        scores = np.asarray(self._retriever.get_scores(tokens), dtype=np.float64)
        order = np.argsort(-scores, kind="stable")[:k]  # stable: ties keep passage order
        return [self.passages[i] for i in order if scores[i] > 0]
