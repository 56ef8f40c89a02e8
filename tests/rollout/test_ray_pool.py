"""RayEnginePool: routing pieces against brute force, answers against TorchEngine (lock-step
calls and the async driver's ``TurnStream``), seeded determinism through ``grow_trees``, both
drivers growing the planned trees, and rollouts that survive a killed worker under either.

One in-process Ray serves the module (≈5 s to start); each pool starts its own actors
(≈3 s, more on a busy machine). The policy is a tiny random Qwen3 with its weights scaled
up, so greedy decoding has no near-ties and can be compared token for token.
"""

from __future__ import annotations

import itertools
import json
import signal
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.models import save_sharpened_policy
from support.planned import check_trees_are_the_planned_ones

from trace_core.algo.plan import Budget
from trace_core.algo.tree import RolloutTree
from trace_core.bench import workers as workers_bench
from trace_core.bench.reload import ReloadBenchConfig, run_reload_bench
from trace_core.bench.workers import (
    SlowTool,
    WorkersBenchConfig,
    WorkersBenchResult,
    WorkersRun,
    percentile,
    run_workers_bench,
)
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import (
    load_checkpoint,
)
from trace_core.policy.sampling import prompt_seeds, request_seed
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.engine_config import DRIVERS, EngineConfig
from trace_core.rollout.engines import EngineSession
from trace_core.rollout.flat import rollout_flat
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor
from trace_core.rollout.ray_pool import Driver, RayEnginePool, ray_session
from trace_core.rollout.routing import PrefixOwners, SubBatch, split_work
from trace_core.rollout.turn import streams

SUITE = CalcSuite(seed=3, train_size=40, eval_size=10)
BUDGET = Budget(roots=8, continuations=2, group=4)  # 8 × (1 + 2/2) = 16 units
GROW = GrowConfig("trace", BUDGET, SamplingParams(max_tokens=10), seed=7)


# -- routing, without Ray --------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
    query=st.lists(st.integers(0, 3), min_size=1, max_size=10),
)
def test_prefix_owners_find_the_longest_recorded_prefix(
    seqs: list[list[int]], query: list[int]
) -> None:
    owners = PrefixOwners()
    truth: dict[tuple[int, ...], int] = {}
    for w, s in enumerate(seqs):
        owners.record(s, w)
        truth[tuple(s)] = w  # a later record of the same sequence wins
    # Brute force: every prefix of the query, longest first.
    expected = next(
        (
            (truth[tuple(query[:k])], k)
            for k in range(len(query), 0, -1)
            if tuple(query[:k]) in truth
        ),
        (None, 0),
    )
    assert owners.lookup(query) == expected


def test_prefix_owners_forget_the_oldest_half_when_full() -> None:
    owners = PrefixOwners(capacity=4)
    for w in range(5):
        owners.record([9, w], w)
    assert len(owners) == 3  # 5 > 4: the oldest 2 of 5 were dropped
    assert owners.lookup([9, 0, 1]) == (None, 0)
    assert owners.lookup([9, 4, 1]) == (4, 2)


def test_split_work_keeps_owners_until_their_share_is_full() -> None:
    # Four groups owned by worker 0 (work 10 at home, 12 away: their prefix is cached on 0),
    # and a new group of 10. Fair share 50 / 2 = 25, cap 25 × 1.25 = 31.25: worker 0 keeps
    # three groups (30); the fourth would end at 40 at home, 12 on worker 1: it moves. The new
    # group then ends at 40 on worker 0, at 22 on worker 1.
    owners = [0, 0, 0, 0, None]
    home = [10.0] * 5
    assert split_work(owners, home, [12.0] * 4 + [10.0], [0, 1], slack=0.25) == [0, 0, 0, 1, 1]
    # Moving costs 100 (a long history to prefill again): staying at 40 is sooner.
    assert split_work(owners, home, [100.0] * 4 + [10.0], [0, 1], 0.25) == [0, 0, 0, 0, 1]
    # A slack that fits everything moves nothing; a lone worker takes everything.
    assert split_work(owners, home, [12.0] * 5, [0, 1], slack=10)[:4] == [0, 0, 0, 0]
    assert split_work(owners, home, [12.0] * 5, [1], slack=0) == [1] * 5


@settings(max_examples=60, deadline=None)
@given(
    work=st.lists(st.integers(1, 100), min_size=1, max_size=7),
    workers=st.integers(1, 3),
)
def test_split_work_without_owners_is_within_grahams_bound(work: list[int], workers: int) -> None:
    """No affinity: longest-processing-time greedy, whose makespan is at most
    (4/3 - 1/(3m)) × the best one (Graham 1969); the best by brute force."""
    chosen = split_work([None] * len(work), work, work, list(range(workers)), slack=0.1)
    assert sorted(set(chosen)) <= list(range(workers))
    makespan = max(
        sum(w for w, c in zip(work, chosen, strict=True) if c == m) for m in range(workers)
    )
    best = min(
        max(sum(w for w, c in zip(work, assign, strict=True) if c == m) for m in range(workers))
        for assign in itertools.product(range(workers), repeat=len(work))
    )
    assert makespan <= (4 / 3 - 1 / (3 * workers)) * best + 1e-9


def test_a_calls_seed_becomes_one_per_prompt() -> None:
    """A sub-batch carries its prompts' own seeds: a prompt's seed is the same whichever
    worker serves it and whatever shares its sub-batch."""
    seeds = prompt_seeds(5, 4)
    assert seeds == [request_seed(5, i) for i in range(4)] == prompt_seeds(5, 4)
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert prompt_seeds([7, 8], 2) == [7, 8]
    assert len(set(prompt_seeds(None, 3) + prompt_seeds(None, 3))) == 6  # fresh each call
    with pytest.raises(ValueError, match="seed: 2 seeds for 3 prompts"):
        prompt_seeds([1, 2], 3)


# -- pools on one in-process Ray -----------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    # One torch thread here too, as in each worker: the reference TorchEngine runs in this
    # process, and two OpenMP threads on a busy 2-core machine run ten times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # 3 logical CPUs (on 2 cores, maybe): the workers bench holds a 1-worker and a
        # 2-worker pool at once, one CPU per worker.
        with ray_session(num_cpus=3):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_sharpened_policy(tmp_path_factory.mktemp("policy"), 0, SUITE.vocabulary())


@pytest.fixture(scope="module")
def fmt(checkpoint: Path) -> TurnFormat:
    return TurnFormat(load_checkpoint(checkpoint)[1])


def check_planned(trees: Sequence[RolloutTree]) -> None:
    check_trees_are_the_planned_ones(trees, len(SUITE.tasks("train")), BUDGET, GROW.seed)
    assert BUDGET.units == 16.0


def grow(engine: RayEnginePool, fmt: TurnFormat) -> list[RolloutTree]:
    return grow_trees(engine, fmt, SUITE.make_env, SUITE.tasks("train"), ConstantPredictor(), GROW)


def assert_same_greedy_answers(
    ours: list[list[Completion]], theirs: list[list[Completion]]
) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.token_ids.dtype == np.int32 and x.logprobs.dtype == np.float32
            assert x.token_ids.tolist() == y.token_ids.tolist()
            assert x.finished == y.finished
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)


@pytest.mark.cluster  # Ray (ray_cluster)
def test_two_workers_answer_every_prompt_in_order_as_torch_engine_does(
    ray_cluster: None, checkpoint: Path, tmp_path: Path
) -> None:
    gen = torch.Generator().manual_seed(0)
    # 12 ragged prompts, two of them equal; the second call extends the first call's prompts.
    prompts = [torch.randint(4, 100, (int(n),), generator=gen).tolist() for n in range(3, 15)]
    prompts[5] = list(prompts[2])
    greedy = SamplingParams(n=2, temperature=0, max_tokens=9)

    def reference(path: Path, prompts: list[list[int]]) -> list[list[Completion]]:
        engine = TorchEngine(load_checkpoint(path)[0])
        return [engine.generate([p], greedy, seed=1)[0] for p in prompts]

    with RayEnginePool(checkpoint, workers=2, max_restarts=1) as pool:
        assert pool.workers == 2 and len(set(pool.worker_pids())) == 2
        for _ in range(2):
            ours = pool.generate(prompts, greedy, seed=1)
            assert_same_greedy_answers(ours, reference(checkpoint, prompts))
            prompts = [
                p + c[0].token_ids.tolist() + [7] for p, c in zip(prompts, ours, strict=True)
            ]
        assert pool.generate([], greedy) == []
        stats = pool.stats
        assert stats.calls == 2
        assert stats.extra["sub_batches"] == 4  # both workers got work in both calls
        # Second call: every prompt extends one a worker served, and stays there.
        assert stats.extra["affinity_kept"] == len(prompts)
        assert stats.generated_tokens == 2 * len(prompts) * 2 * 9
        assert stats.prefill_tokens < stats.prompt_tokens  # the extensions hit the caches

        # New weights, then a crash: the restarted actor boots with the constructor's
        # checkpoint and must reload the new one before it answers.
        new = save_sharpened_policy(tmp_path / "new", 1, SUITE.vocabulary())
        pool.update_weights(new)
        killed = pool.kill_worker_process(0, signal.SIGKILL)
        assert_same_greedy_answers(pool.generate(prompts, greedy, seed=1), reference(new, prompts))
        assert killed not in pool.worker_pids() and pool.workers == 2


def turns_of(trees: Sequence[RolloutTree]) -> list[list[tuple[object, ...]]]:
    """Each tree's turns in a canonical order: (tokens from the root to the turn's end, its
    tokens, reward, logprobs). Node ids follow the order turns came back, which depends on
    timing; what was sampled does not."""
    out = []
    for tree in trees:
        turns = []
        for node in range(1, len(tree.parent)):
            path = tree.path(node)[1:]
            history = tuple(int(t) for n in path for t in tree.gen_tokens[int(n)])
            reward = None if np.isnan(tree.reward[node]) else float(tree.reward[node])
            tokens = tuple(tree.gen_tokens[node].tolist())
            turns.append((history, tokens, reward, tree.logprobs[node]))
        out.append(sorted(turns, key=lambda t: (t[0], t[1])))
    return out


def differing_turns(ours: Sequence[RolloutTree], theirs: Sequence[RolloutTree]) -> float:
    """The share of ``ours``'s turns that ``theirs`` lacks (same history, same tokens, same
    reward); where both have a turn, its logprobs agree within float rounding."""
    a, b = turns_of(ours), turns_of(theirs)
    assert len(a) == len(b)
    missing = total = 0
    for x, y in zip(a, b, strict=True):
        there = {t[:3]: t[3] for t in y}
        for turn in x:
            total += 1
            if turn[:3] not in there:
                missing += 1
            else:
                np.testing.assert_allclose(turn[3], there[turn[:3]], atol=1e-4)
    return missing / total


@pytest.mark.cluster  # Ray (ray_cluster)
def test_a_seed_grows_the_same_trees_on_any_number_of_workers_with_either_driver(
    ray_cluster: None, checkpoint: Path, fmt: TurnFormat
) -> None:
    """Every turn samples with its own seed (``rollout.turn.turn_seed``) and every engine
    samples each request from its own key, so which turns meet in an engine call (timing,
    worker count, driver) changes what is sampled only through float rounding: rows of other
    batch shapes get logits that differ in the last bits, and a draw that lands that close
    to the edge between two tokens flips (then the rest of its episode differs). Measured on
    the tiny policy in float32 (≈ 100 turns): every configuration here 0.0% in one run (the
    shares are printed); an in-process engine with ``max_batch`` 3 against the default one,
    2 of 102 turns (one flip, a token of p ≈ 1e-4 beside its neighbour)."""
    local = grow_trees(
        TorchEngine(load_checkpoint(checkpoint)[0]), fmt, SUITE.make_env, SUITE.tasks("train"),
        ConstantPredictor(), GROW,
    )  # fmt: skip
    check_planned(local)
    assert sum(t.generated_tokens for t in local) > 0
    # (workers, driver, threads a worker): a 2-thread worker's TorchEngine decodes on two
    # forked replicas (policy.replicas).
    runs = [(1, "async", 1), (2, "async", 1), (2, "lock-step", 1), (2, "continuous", 1)]
    for workers, driver, threads in [*runs, (1, "continuous", 2)]:
        with RayEnginePool(
            checkpoint, workers=workers, driver=driver, threads_per_worker=threads
        ) as pool:
            trees = grow(pool, fmt)
            # The pool counts every token its workers generated, and every one is in a tree.
            assert pool.stats.generated_tokens == sum(t.generated_tokens for t in trees)
        share = differing_turns(trees, local)
        name = f"{workers} workers × {threads} threads, {driver}"
        print(f"{name}: {share:.1%} of turns differ")
        assert share <= 0.1, f"{name}: {share:.1%} of turns differ"


class KillingPool(RayEnginePool):
    """Kills the process of a worker that has a sub-batch in flight, on call ``at_call`` (the
    async driver counts every sub-batch it starts as a call)."""

    at_call = 3
    killed: list[int]

    def _submitted(self, call: int, plan: Sequence[SubBatch]) -> None:
        if call == self.at_call:
            self.victim = plan[0].worker
            self.killed = [self.kill_worker_process(self.victim, signal.SIGKILL)]


@pytest.mark.cluster  # Ray (ray_cluster)
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_killed_worker_is_restarted_and_its_sub_batch_rerun(
    ray_cluster: None, checkpoint: Path, fmt: TurnFormat, driver: Driver
) -> None:
    with KillingPool(checkpoint, workers=2, max_restarts=2, driver=driver) as pool:
        trees = grow(pool, fmt)
        pids = pool.worker_pids()
        assert pool.killed[0] not in pids  # the victim runs in a new process now
        assert pool.workers == 2
        assert "resubmitted_sub_batches" not in pool.stats.extra  # Ray reran it in place
    check_planned(trees)


@pytest.mark.cluster  # Ray (ray_cluster)
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_worker_that_stays_dead_has_its_sub_batch_resubmitted(
    ray_cluster: None, checkpoint: Path, fmt: TurnFormat, driver: Driver
) -> None:
    """Async, the dead worker's queued turns are routed again too; continuous, every turn it
    had in flight."""
    with KillingPool(checkpoint, workers=2, max_restarts=0, driver=driver) as pool:
        trees = grow(pool, fmt)
        assert pool.workers == 1
        if driver == "continuous":
            assert pool.stats.extra["resubmitted_turns"] >= 1
        else:
            assert pool.stats.extra["resubmitted_sub_batches"] == 1
        assert pool.stats.extra["dead_workers"] == 1
    check_planned(trees)


@pytest.mark.cluster  # Ray (ray_cluster)
def test_workers_bench_times_every_engine_on_the_same_workload(
    ray_cluster: None, checkpoint: Path, tmp_path: Path
) -> None:
    """A tiny ``bench workers`` with 1 and 2 Ray workers (3 of the module's logical CPUs), each
    pool driven lock-step, async and continuous."""
    config = WorkersBenchConfig(
        checkpoint, prompts=8, roots=4, continuations=2, max_tokens=6, repeats=1,
        workers=(1, 2), drivers=("lock-step", "async", "continuous"), cache_tokens=4096,
    )  # fmt: skip
    result = run_workers_bench(config)
    local, one, one_async, one_cont, two, two_async, two_cont = result.runs
    assert [r.engine for r in result.runs] == [
        "in-process", "torch ray×1", "torch ray×1 async", "torch ray×1 continuous",
        "torch ray×2", "torch ray×2 async", "torch ray×2 continuous",
    ]  # fmt: skip
    assert [r.workers for r in result.runs] == [0, 1, 1, 1, 2, 2, 2]
    assert two.imbalance_share >= 0 and two_async.imbalance_share == 0  # no lock-step call
    for run in result.runs:
        assert run.units == 8.0  # 4 × (1 + 2/2): the same workload on every engine
        assert run.generated_tokens > 0 and run.seconds > 0 and 0 < run.busy_share <= 1
        assert run.tokens_per_s == pytest.approx(run.generated_tokens / run.seconds)
        # Rows per decode step: at least one, at most the engines' rows (8 roots at most
        # live at once on one engine here, stage 2 adding continuations).
        assert 1 <= run.rows_in_flight <= 16 and 1 <= run.rows_p95 <= 16
        assert run.idle_share == pytest.approx(1 - run.busy_share)
    # The ratio is ray×2 over ray×1, from those two runs (not the in-process one).
    assert result.ratio == pytest.approx(two.tokens_per_s / one.tokens_per_s)
    result.write_json(tmp_path / "bench.json")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data) == {"config", "runs", "ratio", "ratios", "load_average", "cpus"}
    assert data["ratio"] == result.ratio
    speed = {r.engine: r.tokens_per_s for r in result.runs}
    assert data["ratios"] == {
        f"{a} / {b}": speed[a] / speed[b]
        for a, b in [
            ("torch ray×2", "torch ray×1"),
            ("torch ray×2 async", "torch ray×1 async"),
            ("torch ray×2 continuous", "torch ray×1 continuous"),
            ("torch ray×1 async", "torch ray×1"),
            ("torch ray×2 async", "torch ray×2"),
            ("torch ray×1 continuous", "torch ray×1 async"),
            ("torch ray×2 continuous", "torch ray×2 async"),
        ]
    }
    assert [r["generated_tokens"] for r in data["runs"]] == [
        r.generated_tokens for r in (local, one, one_async, one_cont, two, two_async, two_cont)
    ]
    assert [r["rows_in_flight"] for r in data["runs"]] == [r.rows_in_flight for r in result.runs]


def test_a_percentile_of_counted_values() -> None:
    assert percentile(Counter({4: 90, 16: 10}), 0.95) == 16.0  # 10% of steps ran 16 rows
    assert percentile(Counter({4: 96, 16: 4}), 0.95) == 4.0
    assert percentile(Counter(), 0.95) == 0.0


def test_workers_bench_refuses_a_ratio_of_one_run_to_itself(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two or more worker counts"):
        WorkersBenchConfig(tmp_path, workers=(1,))
    with pytest.raises(ValueError, match="two or more worker counts"):
        WorkersBenchConfig(tmp_path, workers=(2, 2))
    with pytest.raises(ValueError, match="drivers must be among async, lock-step, continuous"):
        WorkersBenchConfig(tmp_path, drivers=("eager",))
    with pytest.raises(ValueError, match="drivers: continuous needs a running batch"):
        WorkersBenchConfig(tmp_path, drivers=("continuous",), engines=("torch", "hf"))
    with pytest.raises(ValueError, match="env_seconds must be >= 0, got -1"):
        WorkersBenchConfig(tmp_path, env_seconds=-1)
    with pytest.raises(ValueError, match="cache_tokens must be >= 2, got 1"):
        WorkersBenchConfig(tmp_path, cache_tokens=1)


def test_a_slow_tool_waits_before_each_step_and_plays_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(workers_bench.time, "sleep", waits.append)
    task = SUITE.tasks("train")[0]
    plain, slow = SUITE.make_env(), SlowTool(SUITE.make_env(), 0.005)
    assert slow.reset(task) == plain.reset(task) and slow.max_turns == plain.max_turns
    steps = [(slow.step(a), plain.step(a)) for a in task.reference]
    assert all(a == b for a, b in steps) and steps[-1][0].reward == 1.0
    assert waits == [0.005] * len(task.reference)


@pytest.mark.cluster  # Ray (ray_cluster)
def test_a_run_keeps_its_pool_and_puts_each_new_policy_in_place(
    ray_cluster: None, checkpoint: Path, tmp_path: Path
) -> None:
    new = save_sharpened_policy(tmp_path / "new", 1, SUITE.vocabulary())
    greedy = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with EngineSession(EngineConfig(workers=1)) as session:
        with session.engine(checkpoint) as first:
            pids = first.worker_pids()  # type: ignore[attr-defined]
        with session.engine(checkpoint) as same:
            assert same is first and session.reloads == 0  # the same policy: nothing to load
        with session.engine(new) as second:
            assert second is first and second.worker_pids() == pids  # type: ignore[attr-defined]
            ours = second.generate(prompts, greedy, seed=1)
        assert session.reloads == 1 and session.reload_seconds > 0
    reference = TorchEngine(load_checkpoint(new)[0])
    assert_same_greedy_answers(ours, [reference.generate([p], greedy, seed=1)[0] for p in prompts])


def test_workers_bench_ratios_compare_worker_counts_and_engine_kinds() -> None:
    def run(engine: str, workers: int, tokens_per_s: float) -> WorkersRun:
        return WorkersRun(engine, workers, 1.0, 1, tokens_per_s, 1, 1.0, 0.0, 0, 0, 8.0)

    result = WorkersBenchResult(
        config={},
        runs=[
            run("in-process", 0, 50.0),
            run("torch ray×1", 1, 100.0),
            run("torch ray×2", 2, 150.0),
            run("vllm ray×1", 1, 300.0),
            run("vllm ray×2", 2, 600.0),
        ],
    )
    assert result.ratio == 1.5  # the first kind's 2 workers over 1
    assert result.ratios() == {
        "torch ray×2 / torch ray×1": 1.5,
        "vllm ray×2 / vllm ray×1": 2.0,
        "vllm ray×1 / torch ray×1": 3.0,
        "vllm ray×2 / torch ray×2": 4.0,
    }
    both = WorkersBenchResult(
        config={},
        runs=[
            run("torch ray×1", 1, 100.0),
            run("torch ray×1 async", 1, 100.0),
            run("torch ray×2", 2, 150.0),
            run("torch ray×2 async", 2, 180.0),
        ],
    )
    assert both.ratio == 1.5  # lock-step's, the first driver timed
    assert both.ratios() == {
        "torch ray×2 / torch ray×1": 1.5,
        "torch ray×2 async / torch ray×1 async": 1.8,
        "torch ray×1 async / torch ray×1": 1.0,
        "torch ray×2 async / torch ray×2": 1.2,
    }


@pytest.mark.cluster  # Ray (ray_cluster)
def test_reload_bench_times_fresh_starts_and_reloads(
    ray_cluster: None, checkpoint: Path, tmp_path: Path
) -> None:
    result = run_reload_bench(ReloadBenchConfig(checkpoint, repeats=1))
    (run,) = result.runs
    assert run.engine == "torch" and run.fresh_seconds > 0 and run.reload_seconds > 0
    assert result.ratios == {"torch": run.fresh_seconds / run.reload_seconds}
    result.write_json(tmp_path / "reload.json")
    assert json.loads((tmp_path / "reload.json").read_text())["ratios"] == result.ratios


# -- the async driver: TurnStream ------------------------------------------------------------

GREEDY = SamplingParams(n=2, temperature=0, max_tokens=9)


def episodes(tree: RolloutTree) -> list[tuple[tuple[str, ...], float]]:
    """Every root-to-leaf episode's actions and reward, sorted."""
    leaves = np.flatnonzero(tree.leaf_mask)
    paths = [tuple(tree.text[int(n)] for n in tree.path(int(leaf))[1:]) for leaf in leaves]
    return sorted(zip(paths, tree.reward[leaves].tolist(), strict=True))


def test_the_driver_setting_is_checked() -> None:
    """By default a pool runs the continuous driver, and the async one for HF engines (no
    running batch to join); a driver is checked by name and against its engine."""
    assert EngineConfig().driver == "auto"
    assert EngineConfig(workers=2).pool_driver == "continuous"
    assert EngineConfig("vllm", workers=2).pool_driver == "continuous"
    assert EngineConfig("hf", workers=2).pool_driver == "async"
    assert EngineConfig(workers=2, driver="lock-step").pool_driver == "lock-step"
    refused = "driver must be one of auto, async, lock-step, continuous; got 'eager'"
    with pytest.raises(ValueError, match=refused):
        EngineConfig(driver="eager")
    with pytest.raises(ValueError, match="driver continuous needs a running batch: engine hf"):
        EngineConfig("hf", workers=2, driver="continuous")
    with pytest.raises(ValueError, match="max_num_seqs and max_num_batched_tokens must be >= 0"):
        EngineConfig("vllm", max_num_seqs=-1)
    with pytest.raises(ValueError, match=r"\(0: vLLM's default\), got 0 and -5"):
        EngineConfig("vllm", max_num_batched_tokens=-5)
    limits = EngineConfig("vllm", max_num_seqs=512, max_num_batched_tokens=8192).vllm_kwargs()
    assert (limits["max_num_seqs"], limits["max_num_batched_tokens"]) == (512, 8192)
    assert EngineConfig("vllm").vllm_kwargs()["max_num_batched_tokens"] is None  # vLLM's own


@pytest.mark.cluster  # Ray (ray_cluster)
def test_a_stream_answers_every_turn_with_its_tag_as_torch_engine_does(
    ray_cluster: None, checkpoint: Path
) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (int(n),), generator=gen).tolist() for n in range(3, 15)]
    reference = TorchEngine(load_checkpoint(checkpoint)[0])
    with RayEnginePool(checkpoint, workers=2) as pool:
        assert streams(pool)
        stream = pool.stream(GREEDY)
        with pytest.raises(RuntimeError, match="nothing in flight"):
            stream.next()
        with pytest.raises(ValueError, match="3 prompts, 2 tags and 3 seeds"):
            stream.submit(prompts[:3], [0, 1], [1, 2, 3])
        stream.submit(prompts, list(range(len(prompts))), list(range(len(prompts))))
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
                    stream.submit([longer], [len(prompts) - 1], [0])
        assert sorted(answered) == list(range(len(prompts)))
        assert_same_greedy_answers(
            [answered[tag] for tag in range(len(prompts))],
            [reference.generate([p], GREEDY, seed=1)[0] for p in prompts],
        )
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
