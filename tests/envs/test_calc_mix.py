"""calc-mix: calc's problems in the saturated-prompt regime (``CalcMixSuite``)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from trace_core.envs.base import replay
from trace_core.envs.calc import HARDEST_SLIP_RATE, MIX, CalcMixSuite, CalcSuite
from trace_core.envs.suites import SYNTHETIC, make_suite
from trace_core.train.warmstart import synthetic_suite


def test_both_splits_hold_the_mix() -> None:
    suite = CalcMixSuite(seed=3, train_size=400, eval_size=200)
    expected = {f"ops={o},digits={d}": count for (o, d), count in MIX}
    for split, size in (("train", 400), ("eval", 200)):
        tasks = suite.tasks(split)
        counts = Counter(t.difficulty for t in tasks)
        assert counts == {label: n * size // 20 for label, n in expected.items()}, split
        assert all(t.id.startswith(f"calc-mix-{split}-") for t in tasks)
    prompts = [t.prompt for split in ("train", "eval") for t in suite.tasks(split)]
    assert len(set(prompts)) == len(prompts)  # no held-out problem is a training one


def test_the_easiest_demonstrations_never_slip_the_hardest_nearly_always() -> None:
    mix, calc = CalcMixSuite(seed=0, train_size=40, eval_size=0), CalcSuite(seed=0)
    rng = np.random.default_rng(0)
    hardest = []
    for task in mix.tasks("train"):
        rate = mix.mistake_rate_for(task)
        if task.difficulty == "ops=1,digits=1":
            assert rate == 0.0
            assert mix.demonstration(task, rng, rate) == task.reference
        elif task.difficulty == "ops=3,digits=3":
            assert rate == HARDEST_SLIP_RATE == 0.9
            hardest.append(task)
        else:  # between: as calc's
            assert rate == calc.mistake_rate_for(task) > 0.0
    # Four actions each slipping 9 times in 10: right about once in 10⁴ demonstrations.
    env = mix.make_env()
    right = 0
    for task in hardest:
        for _ in range(50):
            _, last = replay(env, task, mix.demonstration(task, rng, HARDEST_SLIP_RATE))
            right += last is not None and last.reward == 1.0
    assert len(hardest) == 10 and right <= 2


def test_every_reference_solves_its_task_and_the_name_is_known() -> None:
    suite = make_suite("calc-mix", seed=1)
    assert isinstance(suite, CalcMixSuite) and "calc-mix" in SYNTHETIC
    assert isinstance(synthetic_suite("calc-mix", 1), CalcMixSuite)
    for task in suite.tasks("eval")[:60]:
        _, last = replay(suite.make_env(), task, task.reference)
        assert last is not None and last.reward == 1.0, task.id
