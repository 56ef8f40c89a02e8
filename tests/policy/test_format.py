"""The turn layout, by the tokenizer's chat template: token-exact at every generation point on
the word tokenizer, SmolLM2's BPE and Qwen's BPE; the end-of-turn token; closing a cut turn."""

from __future__ import annotations

import pytest
from support.models import QWEN_LIKE_TEMPLATE, qwen_tokenizer, smollm2_dir
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trace_core.envs.base import TaskSuite, replay
from trace_core.envs.bfcl import BfclSuite
from trace_core.envs.calc import CalcSuite
from trace_core.envs.multihop import MultihopSuite
from trace_core.policy.format import WORD_TEMPLATE, TurnFormat, TurnStyle
from trace_core.policy.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["What is 2 + 3?", "answer(5)", "wrong, try again"])
FMT = TurnFormat(TOK, TurnStyle("left out: the word tokenizer has no system turn"))
CALC = CalcSuite(train_size=40, eval_size=40)
MULTIHOP = MultihopSuite(train_size=20, eval_size=20)


def conversations(suite: TaskSuite, n: int) -> list[tuple[str, list[str], list[str]]]:
    """(question, turns, observations between them) of the first ``n`` reference solutions."""
    env, out = suite.make_env(), []
    for task in suite.tasks("train")[:n]:
        observations, _ = replay(env, task, task.reference)
        turns = list(task.reference[: len(observations) - 1])
        out.append((task.prompt, turns, observations[1:-1]))  # the last one ends the episode
    return out


def assert_exact(fmt: TurnFormat, suite: TaskSuite, n: int) -> None:
    for question, turns, observations in conversations(suite, n):
        assert fmt.template_mismatch(question, turns, observations) is None, question[:60]


# --- the word tokenizer: its own template, the layout every earlier run used ---------------------
def test_word_layout_is_the_chatml_of_earlier_runs() -> None:
    rollout = FMT.prompt_ids("What is 2 + 3?") + FMT.action_ids("answer(5)")
    rollout += FMT.observation_ids("wrong, try again")
    assert TOK.decode(rollout) == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
        "answer(5)<|im_end|>"
        "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"
    )
    start, end = TOK.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert rollout.count(start) == 4 and rollout.count(end) == 3  # each marker is one id
    assert FMT.system is None and FMT.observation_role == "user"
    assert FMT.end_of_turn_id == TOK.eos_token_id == 3 and FMT.stop_ids == (3,)


def test_word_tokenizer_carries_its_template_and_older_checkpoints_get_it() -> None:
    assert TOK.chat_template == WORD_TEMPLATE
    old = build_word_tokenizer(["a"])
    old.chat_template = None  # a checkpoint saved before templates
    assert TurnFormat(old).prompt_ids("a") == TurnFormat(build_word_tokenizer(["a"])).prompt_ids(
        "a"
    )


@pytest.mark.parametrize("suite", [CALC, MULTIHOP], ids=["calc", "multihop"])
def test_word_tokenizer_is_token_exact_on_reference_solutions(suite: TaskSuite) -> None:
    fmt = TurnFormat(build_word_tokenizer(suite.vocabulary()))  # type: ignore[attr-defined]
    assert_exact(fmt, suite, 20)


def test_actions_end_with_the_end_token_and_decode_without_it() -> None:
    ids = FMT.action_ids("answer(5)")
    assert ids[-1] == FMT.end_of_turn_id and ids.count(FMT.end_of_turn_id) == 1
    assert FMT.decode_action(ids) == "answer(5)"
    assert FMT.decode_action(ids[:-1]) == "answer(5)"  # cut by max_tokens: nothing to strip
    assert FMT.ends_turn(ids) and not FMT.ends_turn(ids[:-1]) and not FMT.ends_turn([])


def test_a_cut_turn_is_closed_before_its_observation() -> None:
    closed = FMT.observation_ids("= 6")
    assert FMT.observation_ids("= 6", closed=False) == [FMT.end_of_turn_id, *closed]


def test_no_bos_or_eos_is_added() -> None:
    assert FMT.encode("answer") == [TOK.convert_tokens_to_ids("answer")]


def test_turn_and_observation_counts_must_interleave() -> None:
    with pytest.raises(ValueError, match="2 turns need 1 or 2 replies"):
        FMT.messages("q", ["a", "b"], [])


def test_a_tokenizer_without_the_markers_is_refused() -> None:
    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
        unk_token="<unk>",
    )
    with pytest.raises(ValueError, match=r"no <\|im_start\|> token"):
        TurnFormat(bare)


def test_a_tokenizer_without_the_role_words_is_refused() -> None:
    """Headers that encode to <unk> would hide who speaks: refuse such a tokenizer."""
    vocab = {"<pad>": 0, "<unk>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "user": 4}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.add_special_tokens(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"])
    old = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", pad_token="<pad>")
    with pytest.raises(ValueError, match=r"role word 'assistant'.*<unk>"):
        TurnFormat(old)


# --- Qwen's BPE vocabulary ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen() -> PreTrainedTokenizerBase:
    return qwen_tokenizer()


def test_qwen_vocabulary_has_qwen_ids(qwen: PreTrainedTokenizerBase) -> None:
    assert qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643,
        151644,
        151645,
    ]
    assert qwen.encode("Hello world", add_special_tokens=False) == [9707, 1879]


@pytest.mark.parametrize("suite", [CALC, MULTIHOP, BfclSuite()], ids=["calc", "multihop", "bfcl"])
def test_qwen_vocabulary_is_token_exact_with_thinking_on(
    qwen: PreTrainedTokenizerBase, suite: TaskSuite
) -> None:
    fmt = TurnFormat(qwen, TurnStyle(suite.instructions, thinking=True))
    assert fmt.observation_role == "tool" and fmt.stop_ids == (151645,)
    assert_exact(fmt, suite, 12)


def test_qwen_thinking_off_renders_the_empty_block_and_reports_the_rewrite(
    qwen: PreTrainedTokenizerBase,
) -> None:
    """Thinking is off by default; the template's empty think block opens every turn, and,
    as in Qwen3's own template, past turns are rendered without it: exact at the first
    generation point, reported inexact at the second."""
    fmt = TurnFormat(qwen, TurnStyle(CALC.instructions))
    assert qwen.decode(fmt.prompt_ids("q")).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    question, turns, observations = conversations(CALC, 1)[0]
    assert fmt.template_mismatch(question, [], []) is None
    assert fmt.template_mismatch(question, turns[:1], []).startswith("last turn")  # type: ignore[union-attr]
    mismatch = fmt.template_mismatch(question, turns, observations)
    assert mismatch is not None and mismatch.startswith("generation point 1")
    assert QWEN_LIKE_TEMPLATE.count("enable_thinking") == 2  # the switch is the template's


def test_a_pretrained_tokenizer_without_a_template_is_refused() -> None:
    bare = qwen_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        TurnFormat(bare)


# --- SmolLM2's BPE vocabulary and template -------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.mark.slow
@pytest.mark.parametrize("suite", [CALC, MULTIHOP, BfclSuite()], ids=["calc", "multihop", "bfcl"])
def test_smollm2_is_token_exact_on_reference_solutions(
    smollm2: PreTrainedTokenizerBase, suite: TaskSuite
) -> None:
    fmt = TurnFormat(smollm2, TurnStyle(suite.instructions))
    assert_exact(fmt, suite, 12)


@pytest.mark.slow
def test_smollm2_system_prompt_replaces_its_default(smollm2: PreTrainedTokenizerBase) -> None:
    fmt = TurnFormat(smollm2, TurnStyle(CALC.instructions))
    text = smollm2.decode(fmt.prompt_ids("What is 12 + 7?"))
    assert text.startswith(f"<|im_start|>system\n{CALC.instructions}<|im_end|>\n")
    assert "SmolLM" not in text
    default = TurnFormat(smollm2)  # no instructions: the template's own default stays
    assert "named SmolLM" in smollm2.decode(default.prompt_ids("q"))
    assert fmt.end_of_turn_id == smollm2.convert_tokens_to_ids("<|im_end|>") == 2
    assert fmt.stop_ids == (2,)  # EOS is the end-of-turn token here
    assert fmt.observation_role == "user"  # its template has no tool role


@pytest.mark.slow
def test_smollm2_turn_cut_then_closed_matches_a_closed_turn(
    smollm2: PreTrainedTokenizerBase,
) -> None:
    fmt = TurnFormat(smollm2, TurnStyle(CALC.instructions))
    turn = fmt.encode("I add. calc[12+")  # cut by max_tokens: no end-of-turn token
    closed = [*turn, *fmt.observation_ids("error: bad expression", closed=fmt.ends_turn(turn))]
    assert closed == [
        *fmt.action_ids("I add. calc[12+"),
        *fmt.observation_ids("error: bad expression"),
    ]
