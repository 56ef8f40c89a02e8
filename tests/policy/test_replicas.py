"""A CPU TorchEngine over forked replicas (``policy.replicas``): the tokens of one process, the
prefix reuse of one cache, fresh weights after an update, and a replica's failure named."""

from __future__ import annotations

import hashlib
import os
import signal

import numpy as np
import pytest
import torch

from trace_core.bench.engine import bench_policy
from trace_core.policy.continuous import Request
from trace_core.policy.engine import Completion, SamplingParams
from trace_core.policy.model import TinyPolicyConfig, create_policy
from trace_core.policy.replicas import ReplicaError, ReplicaPool, block_hashes
from trace_core.policy.sampling import request_keys
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.batch_loop import BatchLoop

MODEL, TOKENIZER, RANDOM_TOKENS = bench_policy(seed=0)
PROMPTS = [RANDOM_TOKENS(32) for _ in range(64)]  # bench engine's throughput workload
PARAMS = SamplingParams(n=1, temperature=1.0, max_tokens=64)
TODAY = {1: "9fdc9a19f474efc0", 2: "2870df91d6839978"}
"""The workload's tokens (sha256 of their int32 bytes) for seeds 1 and 2, as the engine drew
them in one process before it had replicas."""


def digest(out: list[list[Completion]]) -> str:
    tokens = np.concatenate([c.token_ids.astype(np.int32) for cs in out for c in cs])
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:16]


@pytest.fixture
def engines() -> list[TorchEngine]:
    made: list[TorchEngine] = []
    yield made
    for engine in made:
        engine.close()


def test_the_bench_workload_draws_todays_tokens_in_one_process_and_over_replicas(
    engines: list[TorchEngine],
) -> None:
    for replicas in (1, 2):
        engine = TorchEngine(MODEL, max_batch=256, replicas=replicas)
        engines.append(engine)
        assert engine.replicas == replicas
        for seed, expected in TODAY.items():
            assert digest(engine.generate(PROMPTS, PARAMS, seed=seed)) == expected, replicas
    pool = engines[1].running_batch()
    assert isinstance(pool, ReplicaPool)
    # Two replicas decoded 32 rows a step each, every row to its 64th token.
    assert engines[1].row_counts == {32: 2 * 2 * 64}
    assert engines[1].stats.generated_tokens == 2 * 64 * 64


def tree_turns(engine: TorchEngine, turns: int = 3) -> list[list[list[int]]]:
    """Six roots, four samples each, every sample continued with an observation for
    ``turns`` turns (a stop token ends some early): the tokens of every turn."""
    gen = torch.Generator().manual_seed(3)
    roots = [(10 + i, *torch.randint(6, 300, (20,), generator=gen).tolist()) for i in range(6)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, stop_token_ids=(7,))
    prompts, seen = roots, []
    for turn in range(turns):
        out = engine.generate(prompts, params, seed=[100 * turn + i for i in range(len(prompts))])
        seen.append([c.token_ids.tolist() for cs in out for c in cs])
        prompts = [
            p + tuple(c.token_ids.tolist()) + (40 + turn, 41, 42)
            for p, cs in zip(prompts, out, strict=True)
            for c in cs[:1]
        ]
    return seen


def test_replicas_grow_a_tree_as_one_engine_does_and_reuse_as_much_of_it(
    engines: list[TorchEngine],
) -> None:
    one = TorchEngine(MODEL, replicas=1)
    two = TorchEngine(MODEL, replicas=2)
    engines += [one, two]
    assert tree_turns(two) == tree_turns(one)
    # A prompt's samples and its next turns went where its KV was: nothing prefilled twice.
    assert two.stats.prefill_tokens == one.stats.prefill_tokens
    assert 0 < two.cache_used == one.cache_used
    assert two.stats.extra["cache_used_tokens"] == one.cache_used
    pool = two.running_batch()
    assert isinstance(pool, ReplicaPool)
    assert min(pool.row_counts) >= 1 and pool.steps >= 12

    before = two.stats.prefill_tokens
    two.generate([PROMPTS[0]], PARAMS, seed=1)
    two.clear_cache()
    two.generate([PROMPTS[0]], PARAMS, seed=1)  # prefilled again: every cache was emptied
    assert two.stats.prefill_tokens - before == 2 * len(PROMPTS[0])


def test_new_weights_reach_the_replicas_whether_loaded_or_synced(
    engines: list[TorchEngine],
) -> None:
    other = create_policy(TOKENIZER, TinyPolicyConfig(), seed=1)
    engine = TorchEngine(MODEL, replicas=2)
    fresh = TorchEngine(other, replicas=1)
    engines += [engine, fresh]
    prompts = PROMPTS[:8]
    before = engine.generate(prompts, PARAMS, seed=1)
    expected = fresh.generate(prompts, PARAMS, seed=1)
    assert digest(before) != digest(expected)

    engine.update_weights(other)
    assert digest(engine.generate(prompts, PARAMS, seed=1)) == digest(expected)

    engine.update_weights(MODEL)
    assert digest(engine.generate(prompts, PARAMS, seed=1)) == digest(before)
    state = other.state_dict()
    sink = engine.weight_sink()
    sink.begin(list(state))
    sink.take(state)
    sink.end()
    assert digest(engine.generate(prompts, PARAMS, seed=1)) == digest(expected)


def test_a_replica_that_fails_or_dies_stops_the_call_and_the_next_call_forks_anew(
    engines: list[TorchEngine],
) -> None:
    engine = TorchEngine(MODEL, replicas=2, cache_tokens=96)
    engines.append(engine)
    expected = TorchEngine(MODEL, cache_tokens=48).generate([PROMPTS[0]], PARAMS, seed=1)
    # A prompt that passes the engine's checks but not its replica's 48 prefix-cache slots.
    refused = r"engine replica 0 failed:(.|\n)*prefix cache \(48 tokens\)"
    with pytest.raises(ReplicaError, match=refused):
        engine.generate([RANDOM_TOKENS(60)], SamplingParams(max_tokens=4), seed=1)
    assert engine.cache.capacity == 1  # the engine's own: its replicas hold the slots
    assert digest(engine.generate([PROMPTS[0]], PARAMS, seed=1)) == digest(expected)

    pool = engine.running_batch()
    assert isinstance(pool, ReplicaPool)
    params = SamplingParams(n=1, max_tokens=400)
    for r, key in enumerate(request_keys(list(range(16)), 1)):
        pool.add(Request(tuple(PROMPTS[r]), params, key), r)
    pool.step()  # sent
    victim = pool._procs[0].pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    died = rf"engine replica 0 died \(killed by SIGKILL: pid {victim}\)"
    with pytest.raises(ReplicaError, match=died):
        while pool.pending:
            pool.wait(1.0)
            pool.step()
    assert pool.pending == 0
    assert digest(engine.generate([PROMPTS[0]], PARAMS, seed=1)) == digest(expected)

    # Found dead by the next request, before any answer says so.
    pool.add(Request(tuple(PROMPTS[0]), params, 1), 0)
    pool.step()
    victim = pool._procs[0].pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    pool._procs[0].join()
    with pytest.raises(ReplicaError, match=f"engine replica 0 died .*pid {victim}"):
        pool.add(Request(tuple(PROMPTS[1]), params, 2), 1)
    assert pool.pending == 0


def test_an_interrupted_call_leaves_nothing_in_flight(
    engines: list[TorchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = TorchEngine(MODEL, replicas=2)
    engines.append(engine)
    expected = digest(engine.generate(PROMPTS[:8], PARAMS, seed=1))

    def interrupted(self: ReplicaPool) -> list[tuple[object, Completion]]:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(ReplicaPool, "step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPTS[:8], PARAMS, seed=1)
    assert engine.running_batch().pending == 0
    assert digest(engine.generate(PROMPTS[:8], PARAMS, seed=1)) == expected


def test_a_batch_loop_drives_the_replicas_turn_by_turn(engines: list[TorchEngine]) -> None:
    engine = TorchEngine(MODEL, replicas=2)
    one = TorchEngine(MODEL, replicas=1)
    engines += [engine, one]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16)
    loop = BatchLoop(engine)
    turns = [(t, PROMPTS[t], 50 + t) for t in range(12)]
    loop.submit(turns[:6], params)
    got: dict[int, list[list[int]]] = {}
    steps, later = 0, turns[6:]
    while len(got) < len(turns):
        collected = loop.collect(wait_s=5.0)
        steps += collected.steps
        got.update(
            (t, [c.token_ids.tolist() for c in cs])
            for t, cs in zip(collected.ids, collected.completions, strict=True)
        )
        if later and got:  # these join while the first ones still decode
            loop.submit(later, params)
            later = []
    alone = one.generate([p for _, p, _ in turns], params, seed=[s for *_, s in turns])
    assert got == {t: [c.token_ids.tolist() for c in cs] for t, cs in enumerate(alone)}
    assert steps > 0 and collected.cache_used_tokens > 0


def test_block_hashes_cover_every_boundary_and_the_whole_prompt() -> None:
    tokens = tuple(range(40))
    hashes = block_hashes(tokens)
    assert len(hashes) == 3  # 16, 32, then the whole 40
    assert block_hashes(tokens[:32]) == hashes[:2]
    assert block_hashes(tokens[:35])[:2] == hashes[:2] and block_hashes(tokens[:35])[2] != hashes[2]
    assert block_hashes(()) == []
