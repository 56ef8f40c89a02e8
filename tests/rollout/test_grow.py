"""Tree growth: budget exactness, prompt-local stage 2, exact token histories, stored scores."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from trace_core.algo.metrics import measure
from trace_core.algo.plan import STRATEGIES, Budget, strategy
from trace_core.algo.tree import ROOT, RolloutTree
from trace_core.envs.base import Task, replay
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.sampling import prompt_seeds
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor


@pytest.fixture(scope="module")
def suite() -> CalcSuite:
    return CalcSuite(seed=3, train_size=40, eval_size=10)


@pytest.fixture(scope="module")
def fmt(suite: CalcSuite) -> TurnFormat:
    return TurnFormat(build_word_tokenizer(suite.vocabulary()))


class ScriptedEngine:
    """A fake engine that plays each task's reference turns, slipping on the final answer of
    some episodes (decided by a hash of the history), and records every call it gets."""

    def __init__(self, fmt: TurnFormat, tasks: Sequence[Task]) -> None:
        self.fmt = fmt
        self.by_prompt = {tuple(fmt.prompt_ids(t.prompt)): t for t in tasks}
        self.calls: list[list[list[int]]] = []
        self.stats = EngineStats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        self.calls.append([list(p) for p in prompts])
        out = []
        for prompt, own in zip(prompts, prompt_seeds(seed, len(prompts)), strict=True):
            task = next(
                t for head, t in self.by_prompt.items() if tuple(prompt[: len(head)]) == head
            )
            turn = list(prompt).count(self.fmt.end_of_turn_id) - 1  # the prompt holds one
            action = task.reference[min(turn, len(task.reference) - 1)]
            if action.startswith("answer[") and hash((tuple(prompt), own)) % 3 == 0:
                action = "answer[0]"  # a slip: mixed outcomes
            ids = np.asarray(self.fmt.action_ids(action), dtype=np.int32)
            out.append([Completion(ids, np.zeros(len(ids), np.float32), True)] * params.n)
        return out


def _grow(engine, fmt, suite, name: str, seed: int = 0, pool=None, roots=12) -> list[RolloutTree]:  # type: ignore[no-untyped-def]
    config = GrowConfig(name, Budget(roots, 2, 4), SamplingParams(max_tokens=24), seed=seed)
    tasks = pool or suite.tasks("train")
    return grow_trees(engine, fmt, suite.make_env, tasks, ConstantPredictor(), config)


@pytest.mark.parametrize("name", [s for s in STRATEGIES if not strategy(s).uses_true_value])
def test_every_strategy_spends_the_budget_exactly(name: str, suite: CalcSuite, fmt) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(fmt, suite.tasks("train"))
    trees = _grow(engine, fmt, suite, name)
    # 12 roots × (1 + 2/2) = 24 units, whichever way they are spent
    assert measure(trees).units == 24.0
    for tree in trees:
        assert not np.isnan(tree.reward[tree.leaf_mask]).any()
        assert not np.isnan(tree.predicted_v[ROOT])
        if strategy(name).flat:
            assert tree.continuations == 0


def test_histories_are_exact_and_envs_restored(suite: CalcSuite, fmt: TurnFormat) -> None:
    engine = ScriptedEngine(fmt, suite.tasks("train"))
    trees = _grow(engine, fmt, suite, "trace")
    asked = {tuple(p) for call in engine.calls for p in call}
    tasks = {t.id: t for t in suite.tasks("train")}
    for tree in trees:
        for leaf in np.flatnonzero(tree.leaf_mask):
            path = tree.path(int(leaf))
            history = list(tree.obs_tokens[ROOT])
            for node in path[1:]:
                assert tuple(history) in asked  # the engine continued exactly this history
                history += [*tree.gen_tokens[node], *tree.obs_tokens[node]]
            # replaying the path's actions in a fresh env gives the leaf's reward
            _, last = replay(
                suite.make_env(), tasks[tree.info.prompt_id], [tree.text[n] for n in path[1:]]
            )
            assert last is not None and last.done and last.reward == tree.reward[leaf]


def test_stage_two_is_prompt_local(suite: CalcSuite, fmt: TurnFormat) -> None:
    # One-op problems end after 2 turns (calc, answer); three-op ones after 4. A prompt with
    # short episodes must branch while the long ones are still rolling out.
    short = next(t for t in suite.tasks("train") if t.difficulty.startswith("ops=1"))
    long = next(t for t in suite.tasks("train") if t.difficulty.startswith("ops=3"))
    engine = ScriptedEngine(fmt, [short, long])
    trees = _grow(engine, fmt, suite, "trace", pool=[short, long], roots=6)  # 3 roots each
    lengths = {tuple(t.obs_tokens[ROOT]): t.depth[t.leaf_mask].max() for t in trees}
    assert (
        lengths[tuple(fmt.prompt_ids(short.prompt))] < lengths[tuple(fmt.prompt_ids(long.prompt))]
    )
    first_branch_call = min(
        i
        for i, call in enumerate(engine.calls)
        for p in call
        if p.count(fmt.end_of_turn_id) >= 1 and _is_continuation(p, trees, fmt)
    )
    # the long prompt's roots take their last turn in call number `longest - 1`; the short
    # prompt's continuations were already in that call or earlier
    longest = max(lengths.values())
    assert first_branch_call <= longest - 1


def _is_continuation(prompt: list[int], trees: list[RolloutTree], fmt: TurnFormat) -> bool:
    for tree in trees:
        for node in np.flatnonzero(tree.branch):
            parent = int(tree.parent[node])
            history = list(tree.obs_tokens[ROOT])
            for n in tree.path(parent)[1:]:
                history += [*tree.gen_tokens[n], *tree.obs_tokens[n]]
            if history == prompt:
                return True
    return False


def test_prefix_scores_are_stored_and_oracle_is_refused(suite: CalcSuite, fmt) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(fmt, suite.tasks("train"))
    for tree in _grow(engine, fmt, suite, "trace"):
        branched_from = {int(tree.parent[n]) for n in np.flatnonzero(tree.branch)}
        assert all(tree.predicted_v[p] == 0.5 for p in branched_from)
    with pytest.raises(ValueError, match="simulator only"):
        GrowConfig("oracle", Budget(4, 2), SamplingParams())


@pytest.mark.slow
def test_real_engine_grows_valid_trees(suite: CalcSuite, fmt: TurnFormat) -> None:
    model = create_policy(fmt.tokenizer, TinyPolicyConfig(), seed=0)
    trees = _grow(TorchEngine(model), fmt, suite, "trace", seed=1)
    again = _grow(TorchEngine(model), fmt, suite, "trace", seed=1)
    assert all(a.equals(b) for a, b in zip(trees, again, strict=True))
    assert measure(trees).units == 24.0


def test_single_turn_prompts_buy_roots_with_their_continuations(fmt: TurnFormat) -> None:
    # An engine that answers at once: no prefix anywhere, so each prompt's m·N continuations
    # become m·N/2 more roots: 12 + 12 = 24 roots, 24 units, no continuation.
    suite = CalcSuite(seed=3, train_size=40, eval_size=10)

    class AnswerAtOnce(ScriptedEngine):
        def generate(self, prompts, params, seed=None):  # type: ignore[no-untyped-def]
            ids = np.asarray(self.fmt.action_ids("answer[1]"), dtype=np.int32)
            return [[Completion(ids, np.zeros(len(ids), np.float32), True)] for _ in prompts]

    trees = _grow(AnswerAtOnce(fmt, suite.tasks("train")), fmt, suite, "trace")
    m = measure(trees)
    assert (m.units, m.root_rollouts, m.continuations) == (24.0, 24, 0)


@pytest.mark.parametrize("where", ["reset", "step"])
def test_a_prompt_whose_env_fails_is_dropped_and_the_rest_grow(
    suite: CalcSuite, fmt: TurnFormat, where: str
) -> None:
    """One task's env raises on every reset, or on every step: that prompt's tree is left out
    and named with its error, the other prompts grow the trees they grow without it."""
    tasks = suite.tasks("train")[:6]
    broken = tasks[2].id

    class Failing:
        def __init__(self) -> None:
            self.env = suite.make_env()
            self.task_id = ""

        def reset(self, task: Task) -> str:
            self.task_id = task.id
            if where == "reset" and task.id == broken:
                raise RuntimeError("the task's sandbox did not start")
            return self.env.reset(task)

        def step(self, action: str):  # type: ignore[no-untyped-def]
            if where == "step" and self.task_id == broken:
                raise ConnectionError("tool server refused\nthe traceback's other lines")
            return self.env.step(action)

    engine = ScriptedEngine(fmt, suite.tasks("train"))
    config = GrowConfig("trace", Budget(12, 2, 4), SamplingParams(max_tokens=24), seed=0)
    dropped: list[tuple[str, str]] = []
    trees = grow_trees(engine, fmt, Failing, tasks, ConstantPredictor(), config, dropped=dropped)
    errors = {
        "reset": "RuntimeError: the task's sandbox did not start",
        "step": "ConnectionError: tool server refused",
    }
    error = errors[where]
    assert dropped == [(broken, error)]
    assert broken not in {t.info.prompt_id for t in trees} and trees
    for tree in trees:
        assert not np.isnan(tree.reward[tree.leaf_mask]).any()
