"""The word-level tokenizer: exact round trips, single-id specials, HF save and load."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from trace_core.policy.tokenizer import SPECIAL_TOKENS, build_word_tokenizer

CORPUS = ["What is 12 + 30?", "The answer is 42.", "search(query='capital of France')"]
WORDS = ["What", "is", "The", "answer", "search", "query", "capital", "of", "France"]
ROLES = ["user", "assistant"]  # the turn headers' words: always in the vocabulary
# Pieces that never merge with a neighbour: digits, punctuation, whitespace.
SEPARATORS = list(string.digits + string.punctuation + " \n\t")
TOK = build_word_tokenizer(CORPUS)


def test_vocabulary_is_specials_then_sorted_pieces() -> None:
    tok = build_word_tokenizer(CORPUS)
    vocab = tok.get_vocab()
    assert [vocab[s] for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    pieces = sorted(set(WORDS) | set(ROLES) | set(SEPARATORS))
    assert [vocab[p] for p in pieces] == list(range(4, 4 + len(pieces)))
    assert len(tok) == 4 + len(pieces)
    # Deterministic: corpus order does not matter.
    assert build_word_tokenizer(CORPUS[::-1]).get_vocab() == vocab


def test_pieces_are_words_digits_and_single_characters() -> None:
    tok = build_word_tokenizer(CORPUS)
    ids = tok.encode("What is 12+30?\n", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == [
        "What",
        " ",
        "is",
        " ",
        "1",
        "2",
        "+",
        "3",
        "0",
        "?",
        "\n",
    ]


def test_specials_are_single_ids_and_eos_is_im_end() -> None:
    tok = build_word_tokenizer(CORPUS)
    text = "<|im_start|>user\nWhat is 1?<|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 2 and ids[-2] == 3  # <|im_start|> ... <|im_end|> \n
    assert ids.count(2) == 1 and ids.count(3) == 1
    assert tok.decode(ids) == text  # "user" is not in CORPUS, but a role word is always known
    assert (tok.pad_token_id, tok.unk_token_id, tok.eos_token_id) == (0, 1, 3)
    assert tok.encode("is", add_special_tokens=True) == tok.encode("is", add_special_tokens=False)


def test_unknown_words_become_unk() -> None:
    tok = build_word_tokenizer(CORPUS)
    space, seven = tok.convert_tokens_to_ids([" ", "7"])
    assert tok.encode("zebra 7", add_special_tokens=False) == [tok.unk_token_id, space, seven]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(WORDS), st.lists(st.sampled_from(SEPARATORS), min_size=1)),
        max_size=12,
    ),
    st.lists(st.sampled_from(SEPARATORS), max_size=3),
)
def test_round_trip_is_exact_for_in_vocabulary_text(
    chunks: list[tuple[str, list[str]]], lead: list[str]
) -> None:
    # Words are always followed by a separator, so two words never fuse into an unseen one.
    text = "".join(lead) + "".join(word + "".join(seps) for word, seps in chunks)
    tok = TOK
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_save_and_load_with_auto_tokenizer(tmp_path) -> None:
    tok = build_word_tokenizer(CORPUS)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>The answer is 42.<|im_end|>"
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    assert loaded.decode(tok.encode(text, add_special_tokens=False)) == text
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 3)
