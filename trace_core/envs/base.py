"""The turn protocol every task speaks: text in, text out, a binary reward at the end.

An episode is a ReAct loop. ``reset(task)`` returns the first observation (the question). Each
agent turn is free text (a thought, if any) ending in one action; the policy stops sampling at
its action-end token, and ``step(action_text)`` answers with an observation. The episode ends
when the agent answers (``answer[...]``) or runs out of turns; only then is the reward 0 or 1.

Nothing the agent writes can raise: a malformed action, an unknown tool or a failing tool call
becomes an observation the agent can read (``error: ...``). Nothing it writes can stall a
rollout either: a turn longer than its task's ``MAX_ACTION_CHARS`` is refused unread
(``refuse_long``), reading the action is one backward pass over the text (``parse_action``), and
tool calls are bounded in time and in the size of what they return (``bounded_call``,
``clip_observation``).

Environments are deterministic given the task and the actions so far. A rollout tree relies on
it: to continue from a prefix, a fresh env is reset and the prefix's actions are replayed.
"""

from __future__ import annotations

import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import numpy as np

Split = Literal["train", "eval"]
T = TypeVar("T")

MAX_OBSERVATION_CHARS = 2000
TOOL_SECONDS = 2.0
DONE = "done"
"""The observation that ends an episode on the agent's answer."""
TURN_LIMIT = "turn limit reached"
"""The observation that ends an episode when ``max_turns`` run out before an answer."""

# An action name is ``[A-Za-z_][A-Za-z0-9_]*``, ASCII only.
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_")
_NAME_FIRST = frozenset(string.ascii_letters + "_")


@dataclass(frozen=True)
class Task:
    """One problem of a task suite."""

    id: str
    """Stable id, unique within the suite."""
    prompt: str
    """The first observation: what the agent is asked."""
    answer: str
    """Reference answer ("" where the reward is a state check, as in bfcl)."""
    difficulty: str
    """A label to group success rates by (e.g. "ops=2,digits=3", "hops=3", "miss_func")."""
    split: Split
    reference: tuple[str, ...] = ()
    """A correct sequence of agent turns (the scripted demonstration or the ground truth)."""


@dataclass(frozen=True)
class Step:
    observation: str
    done: bool
    reward: float  # 0 or 1; always 0 before the episode is done


class Env(Protocol):
    """One episode at a time; ``reset`` starts a new one."""

    max_turns: int

    def reset(self, task: Task) -> str: ...

    def step(self, action: str) -> Step: ...


class TaskSuite(Protocol):
    """A family of tasks: its problems, and environments to solve them in."""

    name: str
    instructions: str
    """The action grammar, stated as the system prompt of a pretrained policy."""

    def tasks(self, split: Split) -> list[Task]: ...

    def make_env(self) -> Env: ...


class DemoSuite(TaskSuite, Protocol):
    """A synthetic suite that can demonstrate its own solutions (for the warm start)."""

    def demonstration(
        self, task: Task, rng: np.random.Generator, mistake_rate: float
    ) -> tuple[str, ...]:
        """Agent turns solving ``task``, each step slipping with probability ``mistake_rate``."""
        ...

    def mistake_rate_for(self, task: Task) -> float:
        """The slip rate that makes demonstrations succeed less often on harder tasks."""
        ...

    def vocabulary(self) -> list[str]:
        """Texts covering everything the suite's prompts, demos and observations can say."""
        ...


@dataclass(frozen=True)
class Action:
    name: str
    argument: str


def parse_action(text: str) -> Action | None:
    """The last ``name[argument]`` of a turn, brackets balanced; None when there is none.

    Text before the action is the agent's thought and is ignored; trailing whitespace is
    allowed, anything else after the closing bracket is not. The name is the run of name
    characters right before the ``[`` that matches the final ``]``, from its first letter or
    underscore on ("x1ab[" names ``x1ab``, "12ab[" names ``ab``, "12[" is no action).

    Linear in the text: only one ``[`` can match the final ``]``, so one backward pass finds it
    (``find_matching_open``) and a second, over the characters before it, reads the name; no
    character is read twice. (Trying each ``name[`` from the last and scanning forward from it
    costs quadratic time on nested heads such as ``"a[" * n + "]" * n``.)
    """
    end = len(text.rstrip())
    opening = find_matching_open(text, end - 1)
    if opening is None:
        return None
    first, i = None, opening - 1
    while i >= 0 and (char := text[i]) in _NAME_CHARS:
        if char in _NAME_FIRST:
            first = i
        i -= 1
    if first is None:
        return None
    return Action(text[first:opening], text[opening + 1 : end - 1].strip())


def find_matching_open(text: str, close: int) -> int | None:
    """The index of the ``[`` that the ``]`` at ``text[close]`` closes; None if none does
    (or ``text[close]`` is not ``]``, or ``close`` is negative).

    One backward pass from ``close``, each character read once, so that tests can count it.
    """
    if close < 0 or text[close] != "]":
        return None
    depth = 1
    for i in range(close - 1, -1, -1):
        char = text[i]
        if char == "]":
            depth += 1
        elif char == "[":
            depth -= 1
            if depth == 0:
                return i
    return None


def refuse_long(action: str, limit: int) -> str | None:
    """The observation refusing a turn longer than ``limit`` characters; None when it fits.

    The limit is on the whole turn the env receives (thought and action), checked before
    anything reads it, so a hostile turn costs one ``len``; each task names its own limit
    (``MAX_ACTION_CHARS``), well above its longest reference turn.
    """
    if len(action) <= limit:
        return None
    return f"error: action longer than {limit} characters"


def clip_observation(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    """Bound what a tool returns, saying that it was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f" ... [truncated {len(text) - limit} chars]"


class ToolTimeout(Exception):
    pass


def bounded_call(fn: Callable[[], T], seconds: float = TOOL_SECONDS) -> T:
    """Run a tool call with a wall-clock bound; raise ``ToolTimeout`` when it is exceeded.

    The call runs in a daemon thread; a call that never returns is abandoned, not killed,
    so tools must not hold locks the env needs later. Envs turn the exception into an
    observation.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # reported to the caller below
            error.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ToolTimeout(f"tool call exceeded {seconds:g} s")
    if error:
        raise error[0]
    return result[0]


@dataclass
class EpisodeState:
    """The turn bookkeeping of an env that ends on ``answer[...]`` or at its turn limit.

    An env calls ``start`` in ``reset``; in ``step``, ``begin_step`` first (it counts the turn),
    then ``finish`` on an answer or ``observe`` on any other turn. A step before the first reset
    or after the episode ended is a bug in the caller, not the agent, so it raises.
    """

    task: Task | None = None
    turns: int = 0
    """Steps taken in this episode, the current one included."""
    done: bool = False

    def start(self, task: Task) -> None:
        self.task, self.turns, self.done = task, 0, False

    def begin_step(self) -> Task:
        """Count a turn; the episode's task. ValueError before ``start`` or after the end."""
        if self.task is None:
            raise ValueError("step() before reset()")
        if self.done:
            raise ValueError("step() after the episode ended; call reset() first")
        self.turns += 1
        return self.task

    def finish(self, correct: bool) -> Step:
        """End on the agent's answer: reward 1 if it is correct, else 0."""
        self.done = True
        return Step(DONE, done=True, reward=1.0 if correct else 0.0)

    def observe(self, observation: str, max_turns: int) -> Step:
        """A tool turn's (clipped) observation, or the end with reward 0 on the last turn."""
        if self.turns >= max_turns:
            self.done = True
            return Step(TURN_LIMIT, done=True, reward=0.0)
        return Step(clip_observation(observation), done=False, reward=0.0)


def replay(env: Env, task: Task, actions: Sequence[str]) -> tuple[list[str], Step | None]:
    """Reset ``env`` on ``task`` and play ``actions``; stop early if the episode ends.

    Returns every observation (the first is the prompt) and the last step (None if no action
    was played). Used by ``trace-rl task check`` and to restore an env at a tree prefix.
    """
    observations = [env.reset(task)]
    last = None
    for action in actions:
        last = env.step(action)
        observations.append(last.observation)
        if last.done:
            break
    return observations, last
