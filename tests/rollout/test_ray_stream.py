"""The async driver: ``TurnStream`` on a ``RayEnginePool``, and ``grow_trees`` through it.

Answers against ``TorchEngine`` token for token (greedy, on a tiny policy with sharpened
weights), turns submitted while another worker decodes, the planned trees through both
drivers, and a stream that survives a killed worker, on one in-process Ray.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from trace_test_models import save_sharpened_policy  # registered by tests/conftest.py
from trace_test_rollouts import check_trees_are_the_planned_ones

from trace_core.algo.plan import Budget
from trace_core.algo.tree import RolloutTree
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import load_checkpoint
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.flat import rollout_flat
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor
from trace_core.rollout.ray_pool import RayEnginePool, ray_session
from trace_core.rollout.routing import SubBatch
from trace_core.rollout.turn import StreamingEngine

SUITE = CalcSuite(seed=3, train_size=40, eval_size=10)
BUDGET = Budget(roots=8, continuations=2, group=4)
GROW = GrowConfig("trace", BUDGET, SamplingParams(max_tokens=10), seed=7)
GREEDY = SamplingParams(n=2, temperature=0, max_tokens=9)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ray_session(num_cpus=2):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_sharpened_policy(tmp_path_factory.mktemp("policy"), 0, SUITE.vocabulary())


@pytest.fixture(scope="module")
def fmt(checkpoint: Path) -> TurnFormat:
    return TurnFormat(load_checkpoint(checkpoint)[1])


def grow(engine: RayEnginePool, fmt: TurnFormat) -> list[RolloutTree]:
    return grow_trees(engine, fmt, SUITE.make_env, SUITE.tasks("train"), ConstantPredictor(), GROW)


def check_planned(trees: Sequence[RolloutTree]) -> None:
    check_trees_are_the_planned_ones(trees, len(SUITE.tasks("train")), BUDGET, GROW.seed)


def episodes(tree: RolloutTree) -> list[tuple[tuple[str, ...], float]]:
    """Every root-to-leaf episode's actions and reward, sorted."""
    leaves = np.flatnonzero(tree.leaf_mask)
    paths = [tuple(tree.text[int(n)] for n in tree.path(int(leaf))[1:]) for leaf in leaves]
    return sorted(zip(paths, tree.reward[leaves].tolist(), strict=True))


def same_greedy(ours: list[Completion], theirs: list[Completion]) -> bool:
    return [c.token_ids.tolist() for c in ours] == [c.token_ids.tolist() for c in theirs]


def test_the_driver_setting_is_checked() -> None:
    assert EngineConfig().driver == "async"
    with pytest.raises(ValueError, match="driver must be one of async, lock-step; got 'eager'"):
        EngineConfig(driver="eager")


@pytest.mark.cluster  # Ray (ray_cluster)
def test_a_stream_answers_every_turn_with_its_tag_as_torch_engine_does(
    ray_cluster: None, checkpoint: Path
) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (int(n),), generator=gen).tolist() for n in range(3, 15)]
    reference = TorchEngine(load_checkpoint(checkpoint)[0])

    def expected(prompt: list[int]) -> list[Completion]:
        return reference.generate([prompt], GREEDY, seed=1)[0]

    with RayEnginePool(checkpoint, workers=2) as pool:
        assert isinstance(pool, StreamingEngine) and pool.driver == "async"
        stream = pool.stream(GREEDY, seed=1)
        with pytest.raises(RuntimeError, match="nothing in flight"):
            stream.next()
        with pytest.raises(ValueError, match="3 prompts but 2 tags"):
            stream.submit(prompts[:3], ["a", "b"])
        stream.submit(prompts, list(range(len(prompts))))
        assert stream.pending == len(prompts)
        answered: dict[int, list[Completion]] = {}
        extended = False
        while stream.pending:
            for tag, completions in stream.next():
                assert tag not in answered
                answered[tag] = completions
                if not extended:  # one turn more, sent while the other worker may decode
                    extended = True
                    longer = prompts[tag] + completions[0].token_ids.tolist() + [7]
                    prompts.append(longer)
                    stream.submit([longer], [len(prompts) - 1])
        assert sorted(answered) == list(range(len(prompts)))
        for tag, completions in answered.items():
            assert same_greedy(completions, expected(prompts[tag])), tag
        stats = pool.stats
        assert stats.extra["sub_batches"] == stats.calls >= 3  # both workers, then the extension
        assert stats.generated_tokens == len(prompts) * 2 * 9
        assert "imbalance_idle_seconds" not in stats.extra  # no lock-step call was made


@pytest.mark.cluster  # Ray (ray_cluster)
def test_both_drivers_grow_the_planned_trees(
    ray_cluster: None, checkpoint: Path, fmt: TurnFormat
) -> None:
    with RayEnginePool(checkpoint, workers=2) as pool:
        streamed = grow(pool, fmt)
        assert "imbalance_idle_seconds" not in pool.stats.extra
        assert pool.stats.generated_tokens == sum(t.generated_tokens for t in streamed)
        pool.driver = "lock-step"
        stepped = grow(pool, fmt)
        assert pool.stats.extra["imbalance_idle_seconds"] >= 0  # generate's own counter
    check_planned(streamed)
    check_planned(stepped)
    assert [t.info.prompt_id for t in streamed] == [t.info.prompt_id for t in stepped]


@pytest.mark.cluster  # Ray (ray_cluster)
def test_greedy_flat_rollouts_are_the_same_through_both_drivers(
    ray_cluster: None, checkpoint: Path, fmt: TurnFormat
) -> None:
    tasks = SUITE.tasks("eval")
    greedy = SamplingParams(n=2, temperature=0, max_tokens=10)
    with RayEnginePool(checkpoint, workers=2) as pool:
        streamed = rollout_flat(pool, fmt, SUITE.make_env, tasks, greedy, seed=3)
        turns = pool.stats.extra["sub_batches"]
        pool.driver = "lock-step"
        stepped = rollout_flat(pool, fmt, SUITE.make_env, tasks, greedy, seed=3)
    assert len(streamed) == len(tasks) and all(t.root_rollouts == 2 for t in streamed)
    # The same episodes; their turns may be numbered in another order (they came back so).
    assert [episodes(t) for t in streamed] == [episodes(t) for t in stepped]
    assert turns > 2  # the first turn's call (two sub-batches), then streamed ones


class KillingPool(RayEnginePool):
    """Kills the process of the worker of the ``at_call``-th sub-batch the stream starts."""

    at_call = 3
    killed: list[int]

    def _submitted(self, call: int, plan: Sequence[SubBatch]) -> None:
        if call == self.at_call:
            self.killed = [self.kill_worker_process(plan[0].worker, signal.SIGKILL)]


@pytest.mark.cluster  # Ray (ray_cluster)
@pytest.mark.parametrize("restarts", [2, 0])
def test_a_stream_survives_a_killed_worker(
    ray_cluster: None, checkpoint: Path, fmt: TurnFormat, restarts: int
) -> None:
    with KillingPool(checkpoint, workers=2, max_restarts=restarts) as pool:
        trees = grow(pool, fmt)
        assert pool.killed and pool.killed[0] not in pool.worker_pids()
        extra = pool.stats.extra
        if restarts:  # Ray restarted the actor and reran the sub-batch in place
            assert pool.workers == 2 and "resubmitted_sub_batches" not in extra
        else:  # gone for good: its sub-batch and its queue went to the other worker
            assert pool.workers == 1
            assert extra["resubmitted_sub_batches"] == 1 and extra["dead_workers"] == 1
    check_planned(trees)
