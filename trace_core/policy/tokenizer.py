"""A word-level tokenizer for the tiny CPU policy, saved and loaded in Hugging Face format.

Every word (``[A-Za-z]+``), digit, punctuation character and whitespace character is its own
token, and the decoder concatenates tokens with nothing in between, so for text whose words
are all in the vocabulary ``decode(encode(x)) == x`` exactly. Words never seen in the corpus
become ``<unk>`` (and decode to the string ``"<unk>"``). Digits, punctuation, whitespace and
the turn headers' role words (``user``, ``assistant``) are always in the vocabulary.

The four special tokens are matched before pre-tokenisation, so each is always one id:
``<pad>`` (0), ``<unk>`` (1), ``<|im_start|>`` (2), ``<|im_end|>`` (3, the action-end / EOS
token). They are the names ChatML uses, and the tokenizer carries the project's ChatML chat
template (``format.WORD_TEMPLATE``), so ``TurnFormat`` lays its turns out as for a pretrained model.

    tok = build_word_tokenizer(["What is 12 + 3?", "15"])
    tok.save_pretrained("ckpt/")   # AutoTokenizer.from_pretrained("ckpt/") reads it back
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trace_core.policy.format import ROLES, WORD_TEMPLATE

PAD = "<pad>"
UNK = "<unk>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD, UNK, IM_START, IM_END)

UPSTREAM = (
    "transformers.PreTrainedTokenizerFast(tokenizer_object, pad_token, eos_token, "
    "extra_special_tokens, clean_up_tokenization_spaces)",
    # The special tokens a tokenizer takes by name (unk_token=...) and answers as <name>_id
    # (pad_token_id, eos_token_id: its __getattr__): the names of this list.
    "transformers.PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES(unk_token, pad_token, "
    "eos_token)",
    "transformers.PreTrainedTokenizerBase.chat_template",
)
"""What this module calls and reads in transformers (``policy.upstream``: entry syntax there)."""

# Alternatives are tried left to right: a run of letters, else one digit, one whitespace
# character, or any other single character (punctuation, operators, non-ASCII symbols).
_PIECE = r"[A-Za-z]+|[0-9]|\s|[^A-Za-z0-9\s]"

# Always in the vocabulary, seen or not: numbers and formulas must never hit <unk>, and the
# turn layout (``format.TurnFormat``) needs the newline and its role words.
_ALWAYS = frozenset(string.digits) | frozenset(string.punctuation) | {" ", "\n", "\t"} | set(ROLES)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(_PIECE), behavior="isolated")


def build_word_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is the specials, then every piece of ``texts`` (sorted).

    Deterministic: the same texts in any order give the same ids.
    """
    split = _pre_tokenizer()
    pieces = set(_ALWAYS)
    for text in texts:
        pieces.update(piece for piece, _ in split.pre_tokenize_str(text))
    pieces.difference_update(SPECIAL_TOKENS)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for piece in sorted(pieces):
        vocab[piece] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = split
    tok.decoder = decoders.Fuse()  # pieces carry their own whitespace: join with ""
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=IM_END,
        extra_special_tokens=[IM_START],
        # The default clean-up glues "a ." into "a.", which would break exact round trips.
        clean_up_tokenization_spaces=False,
    )
    out.chat_template = WORD_TEMPLATE  # saved as chat_template.jinja beside the vocabulary
    return out


def padding_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id batches are padded with: the pad token, else the EOS token (the Llama 3 family
    has no pad token), else 0. Padding is masked out of every loss and attention, so any id in
    the vocabulary serves; it must only be an int, never None."""
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if pad is not None:
            return int(pad)
    return 0
