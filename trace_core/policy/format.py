"""The chat-style turn layout: how env text becomes the token ids a policy sees.

One layout for the tiny word tokenizer and for a real Qwen3 tokenizer (the ChatML markers
without a system prompt and without Qwen3's ``<think>`` block)::

    <|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n     <- prompt_ids
    {action}<|im_end|>                                                   <- sampled (or action_ids)
    \\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n <- observation_ids
    {action}<|im_end|>
    ...

A rollout is the plain concatenation of these pieces, never re-tokenised: the engine samples
token ids, and the env's reply is encoded on its own and appended. Nothing is added
automatically (no BOS, no EOS); the markers are special tokens, so each encodes to one id.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ROLES = ("user", "assistant")
"""The words of the turn headers: a tokenizer must encode them (``build_word_tokenizer`` always
includes them)."""


class TurnFormat:
    """Encodes questions, actions and observations in the turn layout above."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        end = tokenizer.convert_tokens_to_ids(IM_END)
        start = tokenizer.convert_tokens_to_ids(IM_START)
        for name, tok_id in ((IM_END, end), (IM_START, start)):
            if not isinstance(tok_id, int) or tok_id == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {name} token; add it as a special token")
        assert isinstance(end, int)
        unk = tokenizer.unk_token_id
        for role in ROLES:
            if unk is not None and unk in tokenizer.encode(role, add_special_tokens=False):
                raise ValueError(
                    f"the tokenizer encodes the role word {role!r} of the turn headers as "
                    f"{tokenizer.unk_token}; rebuild it with the word in its vocabulary "
                    "(a checkpoint from before this check: run trace-rl warmstart again)"
                )
        self.action_end_id: int = end
        """Ends every action; the engine's stop token."""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, question: str) -> list[int]:
        """The first turn: the question, then the assistant header the policy continues from."""
        return self.encode(f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n")

    def observation_ids(self, observation: str) -> list[int]:
        """Appended after an action that ended with ``<|im_end|>``; ends at the next header."""
        return self.encode(f"\n{IM_START}user\n{observation}{IM_END}\n{IM_START}assistant\n")

    def action_ids(self, text: str) -> list[int]:
        """A demonstrated action (SFT), ending with the action-end token as a sampled one would."""
        return [*self.encode(text), self.action_end_id]

    def decode_action(self, ids: Sequence[int]) -> str:
        """The text of an action, without its trailing ``<|im_end|>`` (if it has one)."""
        ids = list(ids)
        if ids and ids[-1] == self.action_end_id:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))
