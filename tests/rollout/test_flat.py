"""``rollout_flat``: n batched multi-turn episodes per task, one flat ``RolloutTree`` each.

The oracle for token exactness is a fake engine that records every prompt it is asked to
continue and every completion it hands back: each tree node must be one of those completions,
sampled from exactly the token history of its parent. Rewards are checked by replaying a
path's decoded actions through a fresh env (envs are deterministic).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.algo.tree import ROOT, RolloutTree, TreeInfo
from trace_core.envs.base import Task, replay
from trace_core.envs.calc import DONE, NO_ACTION, TURN_LIMIT, CalcSuite
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.flat import rollout_flat

SUITE = CalcSuite(seed=0, train_size=9, eval_size=9)
TASKS = SUITE.tasks("eval")[:6]  # ops=1..2 × digits=1..3: references of 2 and 3 turns
MAX_TURNS = SUITE.max_turns  # 6
FMT = TurnFormat(build_word_tokenizer(SUITE.vocabulary()))
END = FMT.end_of_turn_id
START = FMT.tokenizer.convert_tokens_to_ids("<|im_start|>")
TurnFn = Callable[[list[int], SamplingParams, np.random.Generator], list[int]]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared CPU, idle OpenMP workers cost more than they give."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# --- fakes and helpers ---------------------------------------------------------------------------


@dataclass
class Call:
    """One ``generate`` call as the engine saw it."""

    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None
    completions: list[list[Completion]]


@dataclass
class RecordingEngine:
    """The ``Engine`` protocol: ``turn(prompt, params, sample_rng)`` writes each completion's
    token ids; every call is recorded. Logprobs are zeros (nothing is sampled from a model)."""

    turn: TurnFn
    stats: EngineStats = field(default_factory=EngineStats)
    calls: list[Call] = field(default_factory=list)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int | None = None
    ) -> list[list[Completion]]:
        rng = np.random.default_rng(seed)
        prompt_lists = [[int(t) for t in p] for p in prompts]
        out = []
        for prompt in prompt_lists:
            samples = []
            for _ in range(params.n):
                ids = np.asarray(self.turn(prompt, params, rng)[: params.max_tokens], np.int32)
                finished = bool(len(ids)) and int(ids[-1]) in params.stop_token_ids
                samples.append(Completion(ids, np.zeros(len(ids), np.float32), finished))
            out.append(samples)
        self.calls.append(Call(prompt_lists, params, seed, out))
        return out


class SpyEngine:
    """A real engine behind the recording: same calls, same answers, all of them kept."""

    def __init__(self, inner: TorchEngine) -> None:
        self.inner, self.stats = inner, inner.stats
        self.calls: list[Call] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int | None = None
    ) -> list[list[Completion]]:
        out = self.inner.generate(prompts, params, seed)
        self.calls.append(Call([[int(t) for t in p] for p in prompts], params, seed, out))
        return out


def task_of(prompt: Sequence[int], tasks: Sequence[Task]) -> tuple[Task, int]:
    """The task whose prompt ``prompt`` extends, and the turn it asks for (0-based).

    The prompt holds two ``<|im_start|>`` (user, assistant); every observation adds two more.
    """
    for task in tasks:
        head = FMT.prompt_ids(task.prompt)
        if list(prompt[: len(head)]) == head:
            return task, (list(prompt).count(START) - 2) // 2
    raise AssertionError("the engine was asked to continue something that is no task's prompt")


def reference_turn(tasks: Sequence[Task]) -> TurnFn:
    """Scripted policy: the task's next reference action, tokenised as a sampled one would be."""

    def turn_fn(prompt: list[int], params: SamplingParams, rng: np.random.Generator) -> list[int]:
        task, t = task_of(prompt, tasks)
        return FMT.action_ids(task.reference[t])

    return turn_fn


def history(tree: RolloutTree, node: int) -> list[int]:
    """root.obs_tokens + Σ (gen_tokens + obs_tokens) along the path to ``node``."""
    out: list[int] = []
    for i in tree.path(node):
        out += tree.gen_tokens[i].tolist() + tree.obs_tokens[i].tolist()
    return out


def check_structure(trees: list[RolloutTree], tasks: Sequence[Task], n: int) -> None:
    """One tree per task in order; n chains from the root; rewards 0/1 on leaves only."""
    assert len(trees) == len(tasks)
    for i, (task, tree) in enumerate(zip(tasks, trees, strict=True)):
        assert tree.info == TreeInfo(prompt_id=task.id, tree_id=i)
        assert tree.obs_tokens[ROOT].tolist() == FMT.prompt_ids(task.prompt)
        assert tree.text[ROOT] == task.prompt
        kids = tree.children()
        assert len(kids[ROOT]) == n
        assert all(len(k) <= 1 for k in kids[1:]), "a flat episode never branches"
        assert tree.root_rollouts == n and tree.continuations == 0 and tree.units == n
        assert tree.leaf_mask.sum() == n
        assert set(tree.reward[tree.leaf_mask].tolist()) <= {0.0, 1.0}
        assert np.isnan(tree.reward[~tree.leaf_mask]).all()
        assert tree.depth.max() <= MAX_TURNS
        dataclasses.replace(tree)  # runs RolloutTree's validation once more
        for node in range(1, tree.size):
            closed = FMT.ends_turn(tree.gen_tokens[node])
            assert tree.truncated[node] == (not closed)  # the fakes stop only at end of turn
            if tree.leaf_mask[node]:
                assert len(tree.obs_tokens[node]) == 0  # nothing is appended after the end
            else:  # a turn cut by max_tokens is closed with the end-of-turn token
                want = FMT.observation_ids(tree.observation[node], closed)
                assert tree.obs_tokens[node].tolist() == want


def check_token_exact(trees: list[RolloutTree], calls: list[Call], tasks: Sequence[Task]) -> None:
    """Every node is one completion the engine returned, sampled from its parent's history."""
    assert calls[0].prompts == [FMT.prompt_ids(t.prompt) for t in tasks]
    sampled = Counter(
        (tuple(prompt), tuple(c.token_ids.tolist()), tuple(c.logprobs.tolist()))
        for call in calls
        for prompt, group in zip(call.prompts, call.completions, strict=True)
        for c in group
    )
    in_trees = Counter(
        (
            tuple(history(tree, int(tree.parent[node]))),
            tuple(tree.gen_tokens[node].tolist()),
            tuple(tree.logprobs[node].tolist()),
        )
        for tree in trees
        for node in range(1, tree.size)
    )
    assert sampled == in_trees
    # Call d continues exactly the episodes still going after d turns.
    for d, call in enumerate(calls[1:], start=1):
        going = Counter(
            tuple(history(tree, int(node)))
            for tree in trees
            for node in np.flatnonzero((tree.depth == d) & ~tree.leaf_mask)
        )
        assert Counter(map(tuple, call.prompts)) == going, d
    # A leaf's full sequence is the prompt it was sampled from plus its own turn.
    for tree in trees:
        for leaf in np.flatnonzero(tree.leaf_mask):
            parent = int(tree.parent[leaf])
            full = history(tree, int(leaf))
            assert full == history(tree, parent) + tree.gen_tokens[leaf].tolist()


def check_replay(trees: list[RolloutTree], tasks: Sequence[Task]) -> None:
    """A fresh env fed a path's decoded actions says the same observations and reward."""
    for task, tree in zip(tasks, trees, strict=True):
        for leaf in np.flatnonzero(tree.leaf_mask):
            path = tree.path(int(leaf))[1:]
            observations, last = replay(SUITE.make_env(), task, [tree.text[i] for i in path])
            assert last is not None and last.done
            assert last.reward == tree.reward[leaf]
            assert observations[1:] == [tree.observation[i] for i in path]


# --- a scripted policy ---------------------------------------------------------------------------


def test_reference_actions_score_one_and_prompts_are_path_histories() -> None:
    engine = RecordingEngine(reference_turn(TASKS))
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_tokens=24)
    trees = rollout_flat(engine, FMT, SUITE.make_env, TASKS, params, seed=0)

    check_structure(trees, TASKS, n=3)
    check_token_exact(trees, engine.calls, TASKS)
    check_replay(trees, TASKS)
    for task, tree in zip(TASKS, trees, strict=True):
        assert (tree.reward[tree.leaf_mask] == 1.0).all()
        # Each of the 3 episodes replays the reference: 1 + 3 × len(reference) nodes.
        assert tree.size == 1 + 3 * len(task.reference)
        for first in tree.children()[ROOT]:
            node, texts = int(first), []
            while True:
                texts.append(tree.text[node])
                kids = tree.children()[node]
                if not len(kids):
                    break
                node = int(kids[0])
            assert tuple(texts) == task.reference
            assert tree.observation[node] == DONE
    # Calls: the first samples n=3 from each raw prompt, later ones n=1 per live episode.
    # TASKS has references of 2 turns (ops=1) and 3 turns (ops=2): 3 calls in all, and the
    # last carries only the ops=2 episodes (3 tasks × 3 episodes = 9 prompts).
    assert [c.params.n for c in engine.calls] == [3, 1, 1]
    assert [len(c.prompts) for c in engine.calls] == [6, 18, 9]
    for call in engine.calls:
        assert call.params.stop_token_ids == (END,)  # defaulted to the action-end token
        assert (call.params.temperature, call.params.top_p, call.params.max_tokens) == (
            0.7,
            0.9,
            24,
        )


def test_first_call_samples_n_from_each_raw_prompt_and_stop_tokens_pass_through() -> None:
    engine = RecordingEngine(reference_turn(TASKS))
    params = SamplingParams(n=2, max_tokens=24, stop_token_ids=(END, 1))
    rollout_flat(engine, FMT, SUITE.make_env, TASKS[:2], params, seed=3)
    first, *later = engine.calls
    assert first.params.n == 2 and first.prompts == [FMT.prompt_ids(t.prompt) for t in TASKS[:2]]
    assert later and all(c.params.n == 1 for c in later)
    assert all(c.params.stop_token_ids == (END, 1) for c in engine.calls)


def test_engine_seeds_follow_the_rollout_seed() -> None:
    def seeds(seed: int) -> list[int | None]:
        engine = RecordingEngine(reference_turn(TASKS))
        rollout_flat(engine, FMT, SUITE.make_env, TASKS, SamplingParams(n=2), seed)
        return [c.seed for c in engine.calls]

    assert seeds(5) == seeds(5)
    assert seeds(5) != seeds(6)


def test_info_callback_names_the_trees() -> None:
    engine = RecordingEngine(reference_turn(TASKS))
    trees = rollout_flat(
        engine,
        FMT,
        SUITE.make_env,
        TASKS[:2],
        SamplingParams(n=1),
        seed=0,
        info=lambda i, task: TreeInfo(run_id="r", iteration=7, prompt_id=task.id, tree_id=10 + i),
    )
    assert [t.info for t in trees] == [
        TreeInfo(run_id="r", iteration=7, prompt_id=TASKS[0].id, tree_id=10),
        TreeInfo(run_id="r", iteration=7, prompt_id=TASKS[1].id, tree_id=11),
    ]


def test_a_policy_that_never_stops_ends_at_the_turn_limit() -> None:
    apples = FMT.encode("apples")[0]

    def garbage(prompt: list[int], params: SamplingParams, rng: np.random.Generator) -> list[int]:
        return [apples] * params.max_tokens  # no action, no action-end token

    engine = RecordingEngine(garbage)
    params = SamplingParams(n=3, max_tokens=10)
    trees = rollout_flat(engine, FMT, SUITE.make_env, TASKS, params, seed=0)

    check_structure(trees, TASKS, n=3)
    check_token_exact(trees, engine.calls, TASKS)
    check_replay(trees, TASKS)
    # Every episode runs max_turns = 6 turns: 1 + 3 × 6 = 19 nodes, 6 engine calls, all
    # rewards 0; each turn is 10 tokens, unfinished, and the env keeps saying there is no action.
    assert len(engine.calls) == MAX_TURNS
    assert all(not c.finished for call in engine.calls for g in call.completions for c in g)
    for tree in trees:
        assert tree.size == 1 + 3 * MAX_TURNS
        assert (tree.depth[tree.leaf_mask] == MAX_TURNS).all()
        assert (tree.reward[tree.leaf_mask] == 0.0).all()
        assert all(len(g) == 10 for g in tree.gen_tokens[1:])
        assert all(tree.text[i] == "apples" * 10 for i in range(1, tree.size))
        inner = [tree.observation[i] for i in range(1, tree.size) if not tree.leaf_mask[i]]
        assert set(inner) == {NO_ACTION}
        assert {tree.observation[i] for i in np.flatnonzero(tree.leaf_mask)} == {TURN_LIMIT}


# --- property: any mix of turns ------------------------------------------------------------------


def menu_turn(tasks: Sequence[Task]) -> TurnFn:
    """Per sample, one of: the next reference action, the right or a wrong answer, a harmless
    calc, or text that never stops; picked by the engine's seeded generator."""
    apples = FMT.encode("apples")[0]

    def turn_fn(prompt: list[int], params: SamplingParams, rng: np.random.Generator) -> list[int]:
        task, t = task_of(prompt, tasks)
        menu = [
            FMT.action_ids(task.reference[min(t, len(task.reference) - 1)]),
            FMT.action_ids(f"answer[{task.answer}]"),
            FMT.action_ids(f"answer[{int(task.answer) + 1}]"),
            FMT.action_ids("calc[1+1]"),
            [apples] * params.max_tokens,
        ]
        return menu[int(rng.integers(len(menu)))]

    return turn_fn


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4),
    tasks=st.integers(1, len(TASKS)),
    seed=st.integers(0, 2**20),
    max_tokens=st.integers(6, 24),
)
def test_any_mix_of_turns_gives_exact_trees(n: int, tasks: int, seed: int, max_tokens: int) -> None:
    picked = TASKS[:tasks]
    engine = RecordingEngine(menu_turn(picked))
    trees = rollout_flat(
        engine, FMT, SUITE.make_env, picked, SamplingParams(n=n, max_tokens=max_tokens), seed
    )
    check_structure(trees, picked, n)
    check_token_exact(trees, engine.calls, picked)
    check_replay(trees, picked)
    for task, tree in zip(picked, trees, strict=True):
        for leaf in np.flatnonzero(tree.leaf_mask):
            # Brute force: a leaf scores 1 exactly when its turn was the right answer.
            right = tree.text[leaf] == f"answer[{task.answer}]"
            assert tree.reward[leaf] == float(right)
            # An episode ends on an answer or at the turn limit, never earlier.
            assert tree.text[leaf].startswith("answer[") or tree.depth[leaf] == MAX_TURNS


# --- a real (random) policy ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_rollout() -> tuple[list[RolloutTree], list[Call]]:
    config = TinyPolicyConfig(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
    )
    model = create_policy(FMT.tokenizer, config, seed=0)
    engine = SpyEngine(TorchEngine(model, max_batch=32, cache_tokens=16_384))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24)
    trees = rollout_flat(engine, FMT, SUITE.make_env, TASKS, params, seed=0)
    return trees, engine.calls


def test_random_policy_trees_are_token_exact(
    random_rollout: tuple[list[RolloutTree], list[Call]],
) -> None:
    trees, calls = random_rollout
    check_structure(trees, TASKS, n=3)
    check_token_exact(trees, calls, TASKS)
    assert [c.params.n for c in calls] == [3] + [1] * (len(calls) - 1)
    for tree in trees:
        assert all(1 <= len(g) <= 24 for g in tree.gen_tokens[1:])
        # A turn that stopped early ended on the action-end token; texts never include it.
        for i in range(1, tree.size):
            gen = tree.gen_tokens[i]
            assert len(gen) == 24 or gen[-1] == END
            assert tree.text[i] == FMT.decode_action(gen.tolist())


def test_random_policy_rewards_replay(
    random_rollout: tuple[list[RolloutTree], list[Call]],
) -> None:
    trees, _ = random_rollout
    check_replay(trees, TASKS)
