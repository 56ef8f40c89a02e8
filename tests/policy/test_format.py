"""The turn layout: exact strings, single-id markers, actions that end with <|im_end|>."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from trace_core.policy.format import TurnFormat
from trace_core.policy.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["What is 2 + 3?", "answer(5)", "wrong, try again"])
FMT = TurnFormat(TOK)


def test_prompt_layout() -> None:
    ids = FMT.prompt_ids("What is 2 + 3?")
    assert TOK.decode(ids) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    # <|im_start|> user \n What ... ? <|im_end|> \n <|im_start|> assistant \n
    start, end = TOK.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[:3] == [start, TOK.convert_tokens_to_ids("user"), TOK.convert_tokens_to_ids("\n")]
    assert ids[-5:] == [end, ids[2], start, TOK.convert_tokens_to_ids("assistant"), ids[2]]
    assert ids.count(start) == 2 and ids.count(end) == 1  # each marker is a single id


def test_observation_follows_an_action() -> None:
    action = FMT.action_ids("answer(5)")
    obs = FMT.observation_ids("wrong, try again")
    rollout = FMT.prompt_ids("What is 2 + 3?") + action + obs
    assert TOK.decode(rollout) == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
        "answer(5)<|im_end|>"
        "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"
    )


def test_actions_end_with_the_end_token_and_decode_without_it() -> None:
    ids = FMT.action_ids("answer(5)")
    assert FMT.action_end_id == TOK.eos_token_id == 3
    assert ids[-1] == FMT.action_end_id and ids.count(FMT.action_end_id) == 1
    assert FMT.decode_action(ids) == "answer(5)"
    assert FMT.decode_action(ids[:-1]) == "answer(5)"  # cut by max_tokens: nothing to strip


def test_no_bos_or_eos_is_added() -> None:
    assert FMT.encode("answer") == [TOK.convert_tokens_to_ids("answer")]


def test_a_tokenizer_without_the_markers_is_refused() -> None:
    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
        unk_token="<unk>",
    )
    with pytest.raises(ValueError, match="im_end"):
        TurnFormat(bare)


def test_a_tokenizer_without_the_role_words_is_refused() -> None:
    """Headers that encode to <unk> would hide who speaks: refuse such a tokenizer."""
    vocab = {"<pad>": 0, "<unk>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "user": 4}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.add_special_tokens(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"])
    old = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", pad_token="<pad>")
    with pytest.raises(ValueError, match=r"role word 'assistant'.*<unk>"):
        TurnFormat(old)
