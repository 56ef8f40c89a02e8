"""Tree growth: budget, predictor, engine and task suite in; one rollout tree per prompt out.

Stage 1 scores the pool's prompts with the predictor and ``plan`` turns the scores into root
counts. Root rollouts are then sampled turn by turn: each engine call carries the next turn of
every live episode of every prompt, so the batch stays full while prompts finish at different
times. Stage 2 is prompt-local: the moment a prompt's last root rollout ends, its visited
non-terminal prefixes are scored, ``RootPlan.expand`` splits the prompt's continuation budget
over them, and the continuations join the very next engine call — no prompt waits for another.

That is the lock-step driver: one engine call per turn-step, all of it awaited. A Ray pool
streams instead (``EngineConfig.driver``): with ``continuous`` (the default) each turn joins
its engine's running batch and comes back the step it finishes (``rollout.ray_continuous``);
with ``async`` each worker's sub-batch comes back the moment it is done
(``rollout.ray_stream``). Either way the returned turns' envs are stepped and the turns they
free are routed at once, while the engines decode; turns of different prompts are in flight
independently.

A continuation restores its env by replaying the prefix's actions (envs are deterministic, see
``envs.base``) and continues from the prefix's exact token history, which the engine's prefix
cache already holds. Every scored node keeps the V it was scored with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trace_core.algo.plan import Budget, RootPlan, plan, strategy
from trace_core.algo.prefix import Predictor
from trace_core.algo.tree import ROOT, RolloutTree, TreeBuilder, TreeInfo, recursive_targets
from trace_core.envs.base import Env, Task, replay
from trace_core.policy.engine import Completion, Engine, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.sampling import request_seed
from trace_core.rollout.turn import Episode, play_turn, streams, turn_seed


@dataclass(frozen=True)
class GrowConfig:
    strategy: str
    budget: Budget
    sampling: SamplingParams
    """Per-turn sampling (``n`` is ignored: counts come from the plan)."""
    seed: int = 0
    run_id: str = "local"
    iteration: int = 0
    policy_version: int = 0

    def __post_init__(self) -> None:
        if strategy(self.strategy).uses_true_value:
            raise ValueError(f"strategy {self.strategy!r} needs the true V: simulator only")


@dataclass
class _Prompt:
    task: Task
    builder: TreeBuilder
    live_roots: int
    expanded: bool = False  # stage 2 has run
    histories: dict[int, list[int]] = field(default_factory=dict)  # node -> history after it
    origins: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """node -> (its episode's key, the turn): which turn of which episode made it. Node ids
    follow the order turns come back (timing); origins do not."""


def grow_trees(
    engine: Engine,
    fmt: TurnFormat,
    make_env: Callable[[], Env],
    pool: Sequence[Task],
    predictor: Predictor,
    config: GrowConfig,
    progress: Callable[[float], None] | None = None,
    dropped: list[tuple[str, str]] | None = None,
) -> list[RolloutTree]:
    """One tree per rolled-out prompt of ``pool`` (prompts given no roots are left out).

    ``progress`` is called with the rollout units spent so far after every engine call. A
    prompt whose env fails (its reset, a step, or the replay before a continuation raises) is
    dropped, not the rollout: its other turns are ignored as they come back, its tree is left
    out, and (its task id, the error in one line) is appended to ``dropped``.
    """
    rng = np.random.default_rng(config.seed)
    prompt_ids = [fmt.prompt_ids(task.prompt) for task in pool]
    scores = predictor.predict_roots(prompt_ids)
    root_plan = plan(config.strategy, scores, config.budget, rng, predictor.continuation_worth)
    turn = SamplingParams(
        n=1,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        max_tokens=config.sampling.max_tokens,
        stop_token_ids=config.sampling.stop_token_ids or fmt.stop_ids,
    )
    prompts: dict[int, _Prompt] = {}
    failed: dict[int, str] = {}  # prompt -> the error that dropped it
    live: list[Episode] = []

    def fail(prompt: int, err: Exception) -> None:
        lines = str(err).strip().splitlines()
        failed[prompt] = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")

    for i in np.flatnonzero(root_plan.counts):
        task = pool[i]
        info = TreeInfo(
            config.run_id,
            config.iteration,
            task.id,
            int(i),
            config.strategy,
            config.policy_version,
        )
        builder = TreeBuilder(info, prompt_tokens=prompt_ids[i], prompt_text=task.prompt)
        builder.set_predicted_v(ROOT, float(scores[i]))
        prompts[int(i)] = _Prompt(task, builder, int(root_plan.counts[i]))
        try:
            episodes = []
            for r in range(int(root_plan.counts[i])):
                env = make_env()
                env.reset(task)
                episodes.append(Episode(int(i), env, ROOT, list(prompt_ids[i]), key=(0, r)))
        except Exception as err:  # the prompt's env: dropped, not the rollout
            fail(int(i), err)
            continue
        live.extend(episodes)
    spent = 0.0

    def advance(episode: Episode, out: Completion) -> list[Episode]:
        """Play one returned turn; the episodes to sample next (itself, continuations)."""
        nonlocal spent
        state = prompts[episode.owner]
        if episode.node == ROOT or episode.branch:
            spent += 1.0 if episode.root_rollout else 0.5
        if episode.owner in failed:  # a turn of a dropped prompt, back from the engine
            return []
        try:
            step = play_turn(episode, out, fmt, state.builder)
            state.origins[episode.node] = (*episode.key, episode.turns)
            if not step.done:
                state.histories[episode.node] = list(episode.history)
                return [episode]
            if episode.root_rollout:
                state.live_roots -= 1
                if state.live_roots == 0 and not state.expanded:  # stage 2 for this prompt
                    state.expanded = True
                    # Its own generator: what a prompt expands does not depend on when it ran.
                    own = np.random.default_rng(request_seed(config.seed, episode.owner))
                    return _expand(episode.owner, state, root_plan, predictor, make_env, own)
        except Exception as err:  # the prompt's env: dropped, not the rollout
            fail(episode.owner, err)
        return []

    def seeds(episodes: list[Episode]) -> list[int]:
        return [turn_seed(config.seed, e) for e in episodes]

    if streams(engine) and live:
        stream = engine.stream(turn)
        stream.submit([e.history for e in live], live, seeds(live))
        while stream.pending:
            freed = [n for episode, out in stream.next() for n in advance(episode, out[0])]
            if freed:
                stream.submit([e.history for e in freed], freed, seeds(freed))
            if progress:
                progress(spent)
        live = []
    while live:  # lock-step: one call per turn-step
        outputs = engine.generate([e.history for e in live], turn, seed=seeds(live))
        live = [n for e, out in zip(live, outputs, strict=True) for n in advance(e, out[0])]
        if progress:
            progress(spent)
    if dropped is not None:
        dropped.extend((pool[i].id, failed[i]) for i in sorted(failed))
    return [_in_turn_order(prompts[i]) for i in sorted(prompts) if i not in failed]


def _in_turn_order(state: _Prompt) -> RolloutTree:
    """The prompt's tree with its nodes in the order of the turns that made them (episode,
    then turn: ``origins``), not the order they came back: what was sampled, laid out the same
    whatever the timing, driver or worker count, so what reads the trees node by node (the
    update's paths and minibatches, the predictor's examples) does not depend on timing."""
    tree = state.builder.build()
    order = sorted(range(1, tree.size), key=lambda node: state.origins[node])
    return tree.reordered([ROOT, *order])


def _expand(
    prompt: int,
    state: _Prompt,
    root_plan: RootPlan,
    predictor: Predictor,
    make_env: Callable[[], Env],
    rng: np.random.Generator,
) -> list[Episode]:
    """Stage 2 for one prompt whose roots are all done: continuations from its prefixes.

    When every root rollout ended after one turn there is no prefix to branch from; the
    continuation budget then buys root rollouts at the same price (two continuations, one
    unit, per root), so every strategy still spends its budget. An odd leftover half unit
    stays unspent.
    """
    if root_plan.continuations[prompt] == 0:
        return []
    tree = state.builder.build()
    prefixes = [int(p) for p in np.flatnonzero(~tree.leaf_mask) if p != ROOT]
    prefixes.sort(key=lambda p: state.origins[p])  # the same order whatever the timing
    if not prefixes:
        extra = int(root_plan.continuations[prompt]) // 2
        state.live_roots += extra
        prompt_ids = list(tree.obs_tokens[ROOT])
        episodes = []
        for r in range(extra):
            env = make_env()
            env.reset(state.task)
            episodes.append(Episode(prompt, env, ROOT, list(prompt_ids), key=(2, r)))
        return episodes
    # Before stage 2 every prefix lies on exactly one root rollout, so the mean reward of the
    # leaves below it (its recursive target) is that rollout's reward.
    rewards = recursive_targets(tree)[prefixes]
    values = predictor.predict([state.histories[p] for p in prefixes])
    for node, v in zip(prefixes, values, strict=True):
        state.builder.set_predicted_v(node, float(v))
    counts = root_plan.expand(prompt, rewards, values, rng)
    episodes = []
    for node, k in zip(prefixes, counts, strict=True):
        path_actions = [tree.text[int(n)] for n in tree.path(node)[1:]]
        for c in range(int(k)):
            env = make_env()
            replay(env, state.task, path_actions)
            history, key = list(state.histories[node]), (1, *state.origins[node], c)
            episodes.append(Episode(prompt, env, node, history, True, False, key))
    return episodes
