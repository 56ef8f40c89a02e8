"""multihop-mix: multihop's questions in the saturated-prompt regime (``MultihopMixSuite``)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from trace_core.envs.base import replay
from trace_core.envs.multihop import (
    HARDEST_SLIP_RATE,
    MIX,
    MultihopMixSuite,
    MultihopSuite,
)
from trace_core.envs.suites import SYNTHETIC, make_suite
from trace_core.train.warmstart import synthetic_suite

SUITE = MultihopMixSuite(seed=0)


def test_both_splits_hold_the_mix_and_share_no_question() -> None:
    expected = {f"hops={hops}": count for hops, count in MIX}
    for split, size in (("train", 1800), ("eval", 200)):
        tasks = SUITE.tasks(split)
        assert Counter(t.difficulty for t in tasks) == {
            label: n * size // 20 for label, n in expected.items()
        }, split
        assert all(t.id.startswith(f"multihop-mix-{split}-") for t in tasks)
    prompts = [t.prompt for split in ("train", "eval") for t in SUITE.tasks(split)]
    assert len(set(prompts)) == len(prompts)


def test_two_hops_never_slip_four_nearly_always_three_as_multihop() -> None:
    plain = MultihopSuite(seed=0, train_size=30, eval_size=0)
    rng = np.random.default_rng(0)
    env = SUITE.make_env()
    right = Counter[str]()
    for task in SUITE.tasks("train")[:60]:
        rate = SUITE.mistake_rate_for(task)
        expected = {"hops=2": 0.0, "hops=4": HARDEST_SLIP_RATE}.get(task.difficulty)
        if expected is None:
            expected = plain.mistake_rate_for(task)
            assert 0.0 < expected < HARDEST_SLIP_RATE
        assert rate == expected, task.id
        for _ in range(5):
            _, last = replay(env, task, SUITE.demonstration(task, rng, rate))
            right[task.difficulty] += last is not None and last.reward == 1.0
    assert right["hops=2"] == 30 * 5  # every 2-hop demonstration is right
    assert right["hops=4"] <= 1  # of 15 × 5, each right with probability 10⁻⁵


def test_every_reference_solves_its_task_and_the_name_is_known() -> None:
    assert "multihop-mix" in SYNTHETIC
    assert isinstance(make_suite("multihop-mix", seed=1), MultihopMixSuite)
    assert isinstance(synthetic_suite("multihop-mix", 1), MultihopMixSuite)
    for task in SUITE.tasks("eval")[:40]:
        _, last = replay(SUITE.make_env(), task, task.reference)
        assert last is not None and last.reward == 1.0, task.id
