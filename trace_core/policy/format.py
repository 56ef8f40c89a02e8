"""The turn layout: how env text becomes the token ids a policy sees, by the model's own chat
template.

A rollout is a conversation: an optional system message stating the task's action grammar, the
question as the user's message, then assistant turns (the policy's thought and action) and
observations (the env's reply, in the template's ``tool`` role when it has one, else ``user``).
For SmolLM2's ChatML template it reads::

    <|im_start|>system\\n{instructions}<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n       <- prompt_ids
    {thought and action}<|im_end|>                                           <- sampled
    \\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n   <- observation_ids
    {thought and action}<|im_end|>
    ...

Token ids in, token ids out: the engine samples a turn's ids, the env's reply is rendered by the
template and encoded on its own, and the rollout is the plain concatenation, never re-tokenised.
Every generation point is exact: the ids the policy continues from equal
``tokenizer.apply_chat_template(conversation so far, add_generation_prompt=True)`` whenever the
sampled turns are the tokenizer's own encoding of their text (``template_mismatch`` checks it;
``trace-rl model check`` reports it as ``template_exact``). That needs a template that only
appends as a conversation grows; one that rewrites earlier turns (Qwen3's drops the empty
``<think>`` block from past turns) is followed at each generation prompt and reported inexact.

Turns end with the template's end-of-turn token; sampling stops there or at EOS. A turn that did
not end with the end-of-turn token (cut by ``max_tokens``, or stopped at a different EOS) is
closed with it before the observation, so the conversation stays well formed; the closing token
is part of the observation ids (it was not sampled, so it is not trained on).

Qwen3-family thinking is off by default: ``enable_thinking=False`` goes to every template
(templates without the switch ignore it); ``TrainConfig.thinking`` turns it on.

The tiny word-level tokenizer has no template from anywhere else, so it carries the project's
own (``WORD_TEMPLATE``, ChatML without a system turn: its vocabulary is the suite's own text,
and the warm start teaches it the grammar instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ROLES = ("user", "assistant")
"""The role words of the word tokenizer's turn headers (``build_word_tokenizer`` includes them)."""

WORD_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""The word tokenizer's chat template: ChatML, observations as user turns, no system prompt."""

# Stand-ins rendered in place of real text to find where a template puts its frames; chosen so
# that no template or tokenizer would produce them on its own.
_QUESTION = "\x00question\x00"
_TURN = "\x00turn\x00"


@dataclass(frozen=True)
class TurnStyle:
    """What the chat template is given besides the conversation."""

    instructions: str | None = None
    """The system prompt: the task's action grammar (a suite's ``instructions``). It replaces a
    template's default system prompt, such as SmolLM2's; the word tokenizer leaves it out."""
    thinking: bool = False
    """``enable_thinking`` of Qwen3-family templates (others ignore it)."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def is_word_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True for the project's word-level tokenizer (``policy.tokenizer``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.model).__name__ == "WordLevel"


class TurnFormat:
    """Encodes questions, turns and observations with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, style: TurnStyle | None = None) -> None:
        style = style or TurnStyle()
        self.tokenizer = tokenizer
        word = is_word_tokenizer(tokenizer)
        template = tokenizer.chat_template or (WORD_TEMPLATE if word else None)
        if not isinstance(template, str):
            raise ValueError(
                "the tokenizer has no chat template (chat_template.jinja or chat_template in "
                "tokenizer_config.json); use an instruct model's directory"
            )
        self.template = template
        self.thinking = style.thinking
        self.system = None if word else style.instructions
        self.observation_role = "tool" if _has_tool_role(template) else "user"
        if word:
            _check_word_vocabulary(tokenizer)
        self.end_of_turn_id = self._find_end_of_turn()
        """Ends every turn of the conversation; the first stop id."""
        eos = tokenizer.eos_token_id
        extra = () if eos is None or eos == self.end_of_turn_id else (int(eos),)
        self.stop_ids: tuple[int, ...] = (self.end_of_turn_id, *extra)
        """Sampling stops after any of these: the end-of-turn token, then EOS if different."""

    # -- rendering ------------------------------------------------------------------------

    def messages(
        self, question: str, turns: Sequence[str] = (), observations: Sequence[str] = ()
    ) -> list[Message]:
        """The conversation: system (if any), question, then turns and observations in turn."""
        if not len(turns) - 1 <= len(observations) <= len(turns):
            raise ValueError(f"{len(turns)} turns need {len(turns) - 1} or {len(turns)} replies")
        out = [Message("system", self.system)] if self.system else []
        out.append(Message("user", question))
        for i, turn in enumerate(turns):
            out.append(Message("assistant", turn))
            if i < len(observations):
                out.append(Message(self.observation_role, observations[i]))
        return out

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            [m.to_json() for m in messages],
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            enable_thinking=self.thinking,
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- the pieces of a rollout ------------------------------------------------------------

    def prompt_ids(self, question: str) -> list[int]:
        """The first generation point: system, question and the assistant's generation prompt."""
        return self.encode(self.render(self.messages(question), generation_prompt=True))

    def observation_ids(self, observation: str, closed: bool = True) -> list[int]:
        """Appended after a turn, up to the next generation prompt; it starts with the
        end-of-turn token unless the turn was ``closed`` by it (``ends_turn``)."""
        text = self.render(self.messages(_QUESTION, [_TURN], [observation]), True)
        ids = self.encode(text[text.index(_TURN) + len(_TURN) :])
        if ids[0] != self.end_of_turn_id:
            raise ValueError("the chat template does not end an assistant turn with one token")
        return ids[1:] if closed else ids

    def ends_turn(self, turn: Sequence[int]) -> bool:
        """Whether sampled ids end with the end-of-turn token (not cut, not another EOS)."""
        return len(turn) > 0 and int(turn[-1]) == self.end_of_turn_id

    def action_ids(self, text: str) -> list[int]:
        """A demonstrated turn (SFT), ending with the end-of-turn token as a sampled one would."""
        return [*self.encode(text), self.end_of_turn_id]

    def decode_action(self, ids: Sequence[int]) -> str:
        """The text of a turn, without its trailing stop token (if it has one)."""
        ids = [int(t) for t in ids]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def conversation_ids(
        self, question: str, turns: Sequence[str], observations: Sequence[str]
    ) -> list[int]:
        """The rollout of these texts, built piece by piece as an episode builds it."""
        return self._build(question, turns, observations)[0]

    def template_mismatch(
        self, question: str, turns: Sequence[str], observations: Sequence[str]
    ) -> str | None:
        """Where the piecewise rollout of this conversation departs from the template's own
        encoding of it, at a generation point or at its end; None when it never does."""
        ids, points = self._build(question, turns, observations)
        for k, point in enumerate(points):
            messages = self.messages(question, turns[:k], observations[:k])
            want = self.encode(self.render(messages, generation_prompt=True))
            if ids[:point] != want:
                return f"generation point {k}: {_first_difference(ids[:point], want)}"
        if len(turns) > len(observations):  # it ends with a turn: the rest of the template
            messages = self.messages(question, turns, observations)
            full = self.encode(self.render(messages, generation_prompt=False))
            if full[: len(ids)] != ids:
                return f"last turn: {_first_difference(ids, full[: len(ids)])}"
        return None

    def _build(
        self, question: str, turns: Sequence[str], observations: Sequence[str]
    ) -> tuple[list[int], list[int]]:
        """The ids, and where each generation point ends in them."""
        self.messages(question, turns, observations)  # checks the counts
        ids = self.prompt_ids(question)
        points = [len(ids)]
        for i, turn in enumerate(turns):
            turn_ids = self.action_ids(turn)
            ids += turn_ids
            if i < len(observations):
                ids += self.observation_ids(observations[i])
                points.append(len(ids))
        return ids, points

    def _find_end_of_turn(self) -> int:
        text = self.render(self.messages(_QUESTION, [_TURN]), generation_prompt=False)
        after = text[text.index(_TURN) + len(_TURN) :]
        ids = self.encode(after)
        special = set(self.tokenizer.all_special_ids) | set(
            self.tokenizer.added_tokens_decoder  # type: ignore[attr-defined]
        )
        if not ids or ids[0] not in special:
            raise ValueError(
                f"the chat template ends an assistant turn with {after!r}, not with a special "
                "token; an end-of-turn token is needed to stop sampling"
            )
        return int(ids[0])


def _has_tool_role(template: str) -> bool:
    """Whether the template renders tool results in a role of their own (``"tool"`` appears
    as a role name in it); otherwise observations go in user turns."""
    return "'tool'" in template or '"tool"' in template


def _check_word_vocabulary(tokenizer: PreTrainedTokenizerBase) -> None:
    unk = tokenizer.unk_token_id
    for name in (IM_START, IM_END):
        tok_id = tokenizer.convert_tokens_to_ids(name)
        if not isinstance(tok_id, int) or tok_id == unk:
            raise ValueError(f"the tokenizer has no {name} token; add it as a special token")
    for role in ROLES:
        if unk is not None and unk in tokenizer.encode(role, add_special_tokens=False):
            raise ValueError(
                f"the tokenizer encodes the role word {role!r} of the turn headers as "
                f"{tokenizer.unk_token}; rebuild it with the word in its vocabulary "
                "(a checkpoint from before this check: run trace-rl warmstart again)"
            )


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if i is None:
        return f"{len(got)} ids where the template has {len(want)}"
    return f"id {i} is {got[i]} where the template has {want[i]}"
