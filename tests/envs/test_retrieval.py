"""SearchIndex: BM25 ranking, ties in passage order, corpora without words."""

from __future__ import annotations

import pytest

from trace_core.envs.retrieval import SearchIndex


def test_equal_scores_rank_in_passage_order() -> None:
    index = SearchIndex(["bb xx .", "aa xx .", "cc xx ."])
    assert index.search("xx", 3) == ["bb xx .", "aa xx .", "cc xx ."]
    assert index.search("XX!", 2) == ["bb xx .", "aa xx ."]


def test_an_index_without_words_finds_nothing() -> None:
    assert SearchIndex(["!", "a ."]).search("a", 2) == []
    assert SearchIndex(["", "hello world"]).search("hello", 2) == ["hello world"]


def test_search_index_needs_passages() -> None:
    with pytest.raises(ValueError, match="at least one passage"):
        SearchIndex([])
