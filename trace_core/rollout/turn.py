"""One agent turn: decode the sampled action, step the env, record the node, extend the history.

Flat rollouts and tree growth advance their episodes the same way; only what happens when an
episode ends differs (a flat episode just stops, a tree's last root rollout triggers stage 2).
Both drive an engine lock-step (``Engine.generate``: one call per turn-step) or, when it is a
``StreamingEngine`` (a Ray pool) set to ``driver="async"`` or ``"continuous"``, through its
``stream``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

from trace_core.algo.tree import TreeBuilder
from trace_core.envs.base import Env, Step
from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.sampling import request_seed


@dataclass
class Episode:
    owner: int
    """The task (flat rollouts) or pool prompt (trees) this episode belongs to."""
    env: Env
    node: int
    """Tree node of its last turn (the root before the first)."""
    history: list[int]
    """Exact token history the next turn continues from."""
    branch: bool = False
    """Its next turn starts a continuation from a prefix."""
    root_rollout: bool = True
    key: tuple[int, ...] = ()
    """Which episode of its owner it is (its turns' seeds come from it, ``turn_seed``)."""
    turns: int = 0
    """Turns played so far."""


def turn_seed(seed: int, episode: Episode) -> int:
    """The seed of ``episode``'s next turn: a function of the rollout's seed, the episode and
    how many turns it has played, never of which turns share an engine call or when it ran."""
    return request_seed(seed, episode.owner, *episode.key, episode.turns)


class TurnStream(Protocol):
    """Turns answered as each worker is done (``rollout.ray_stream``, the async driver)."""

    @property
    def pending(self) -> int: ...

    def submit(
        self, prompts: Sequence[Sequence[int]], tags: Sequence[Episode], seeds: Sequence[int]
    ) -> None: ...

    def next(self) -> list[tuple[Episode, list[Completion]]]: ...


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that can also stream turns: a Ray pool (``EngineConfig.driver``)."""

    driver: str

    def stream(self, params: SamplingParams) -> TurnStream: ...


def streams(engine: object) -> TypeGuard[StreamingEngine]:
    """Whether a stream drives ``engine``: a streaming engine set to ``async`` or
    ``continuous``."""
    return isinstance(engine, StreamingEngine) and engine.driver in ("async", "continuous")


def play_turn(
    episode: Episode, completion: Completion, fmt: TurnFormat, builder: TreeBuilder
) -> Step:
    """Play one sampled turn in the episode's env and record it under ``episode.node``."""
    action = fmt.decode_action(completion.token_ids)
    step = episode.env.step(action)
    closed = fmt.ends_turn(completion.token_ids)
    obs_ids = [] if step.done else fmt.observation_ids(step.observation, closed)
    episode.node = builder.add_turn(
        episode.node,
        gen_tokens=completion.token_ids,
        obs_tokens=obs_ids,
        logprobs=completion.logprobs,
        text=action,
        observation=step.observation,
        branch=episode.branch,
        truncated=not completion.finished,
    )
    episode.branch = False
    episode.turns += 1
    if step.done:
        builder.set_reward(episode.node, step.reward)
    else:
        episode.history.extend(int(t) for t in completion.token_ids)
        episode.history.extend(obs_ids)
    return step
