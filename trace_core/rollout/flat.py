"""Flat multi-turn rollouts: n independent ReAct episodes per task, batched turn by turn.

Every live episode's next turn is sampled in one engine call, so a batch of tasks advances
together; an episode leaves the batch when its env says done. On a Ray pool with the async
driver (``EngineConfig.driver``) the turns after the first stream instead: each worker's come
back when it is done and go out again at once (``rollout.ray_stream``). The first turn of a task's n
episodes is one prompt with n samples (one prefill); later turns extend each episode's own
history, which the engine's prefix cache already holds up to the new observation tokens.

The result is one flat ``RolloutTree`` per task (the root's children are its episodes), in
the same schema the tree strategies produce, so evaluation, the demo and the Parquet store
all read one format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trace_core.algo.tree import ROOT, RolloutTree, TreeBuilder, TreeInfo
from trace_core.envs.base import Env, Task
from trace_core.policy.engine import Completion, Engine, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.sampling import request_seed
from trace_core.rollout.turn import Episode, play_turn, streams, turn_seed


def rollout_flat(
    engine: Engine,
    fmt: TurnFormat,
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    params: SamplingParams,
    seed: int,
    info: Callable[[int, Task], TreeInfo] | None = None,
    failed: dict[int, str] | None = None,
) -> list[RolloutTree]:
    """``params.n`` episodes of every task; one tree per task, in task order.

    ``params.n`` is the group size: each task's first turn is sampled n times from one
    prefill; every later turn is sampled once per episode. With ``failed``, an env that raises
    (a retrieval service that stays down) ends that task's episodes and is recorded there, task
    index -> one line, instead of ending the rollout; that task's tree is then incomplete.
    """
    turn_params = SamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids or fmt.stop_ids,
    )
    first_params = SamplingParams(
        n=params.n,
        temperature=turn_params.temperature,
        top_p=turn_params.top_p,
        max_tokens=turn_params.max_tokens,
        stop_token_ids=turn_params.stop_token_ids,
    )
    builders = []
    live: list[Episode] = []
    prompts = []
    for i, task in enumerate(tasks):
        tree_info = info(i, task) if info else TreeInfo(prompt_id=task.id, tree_id=i)
        prompt = fmt.prompt_ids(task.prompt)
        builders.append(TreeBuilder(tree_info, prompt_tokens=prompt, prompt_text=task.prompt))
        prompts.append(prompt)

    def seeds(episodes: list[Episode]) -> list[int]:
        return [turn_seed(seed, e) for e in episodes]

    # Turn 1: n samples per task from one prefill each (sample j is episode j's first turn).
    first = engine.generate(
        prompts, first_params, seed=[request_seed(seed, i) for i in range(len(tasks))]
    )

    def fail(task: int, err: Exception) -> None:
        if failed is None:
            raise err
        lines = str(err).strip().splitlines()
        failed.setdefault(task, f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": "))

    pending = []
    for i, task in enumerate(tasks):
        for j, completion in enumerate(first[i]):
            env = make_env()
            try:
                env.reset(task)
            except Exception as err:  # the task's env: recorded in failed, or raised
                fail(i, err)
                break
            pending.append((Episode(i, env, ROOT, list(prompts[i]), key=(j,)), completion))

    origins: list[dict[int, tuple[int, ...]]] = [{} for _ in tasks]  # node -> (sample, turn)

    def play(turns: Sequence[tuple[Episode, Completion]]) -> list[Episode]:
        """Play the returned turns; the episodes that go on."""
        going = []
        for e, c in turns:
            if failed and e.owner in failed:  # a task already failed: its episodes end
                continue
            try:
                step = play_turn(e, c, fmt, builders[e.owner])
            except Exception as err:  # the task's env: recorded in failed, or raised
                fail(e.owner, err)
                continue
            origins[e.owner][e.node] = (*e.key, e.turns)
            if not step.done:
                going.append(e)
        return going

    live = play(pending)
    if streams(engine) and live:
        stream = engine.stream(turn_params)
        stream.submit([e.history for e in live], live, seeds(live))
        while stream.pending:
            live = play([(e, out[0]) for e, out in stream.next()])
            if live:
                stream.submit([e.history for e in live], live, seeds(live))
        live = []
    while live:  # lock-step: one call per turn-step
        outputs = engine.generate([e.history for e in live], turn_params, seed=seeds(live))
        live = play([(e, out[0]) for e, out in zip(live, outputs, strict=True)])
    # Nodes in the order of the turns that made them, not the order they came back.
    trees = [b.build() for b in builders]
    return [
        tree.reordered([ROOT, *sorted(range(1, tree.size), key=origin.__getitem__)])
        for tree, origin in zip(trees, origins, strict=True)
    ]
