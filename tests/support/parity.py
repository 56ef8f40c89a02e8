"""The parity task the loop and step tests train on, their tiny policy's size and loop
config, and the comparisons of two runs' logs and trees."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Split, Step, Task
from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig
from trace_core.policy.update_config import UpdateConfig
from trace_core.train.config import TrainConfig
from trace_core.train.record import IterationRecord

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


class ParityEnv:
    """Two turns; the reward is 1 when the two actions together have an even length.

    A random policy wins half the time, so every estimator has contrast to push on, and a
    policy can learn it; the env is deterministic given the actions (continuations replay)."""

    max_turns = 2

    def reset(self, task: Task) -> str:
        self.actions: list[str] = []
        return task.prompt

    def step(self, action: str) -> Step:
        self.actions.append(action)
        if len(self.actions) < 2:
            return Step("ok", False, 0.0)
        return Step("done", True, float(len("".join(self.actions)) % 2 == 0))


class ParitySuite:
    """Calc's prompts and tokenizer vocabulary with the parity env."""

    name = "calc"
    instructions = "Say anything; the reward is the parity of the last digit."

    def __init__(self) -> None:
        self.calc = CalcSuite(seed=0, train_size=40, eval_size=8)

    def tasks(self, split: Split) -> list[Task]:
        return self.calc.tasks(split)

    def make_env(self) -> ParityEnv:
        return ParityEnv()


def tiny(init: Path, output: Path, iterations: int, **kwargs: object) -> TrainConfig:
    """A loop of a few seconds an iteration on the parity task (``ParitySuite``)."""
    return replace(
        TrainConfig(
            output=output,
            init=init,
            strategy="trace",
            iterations=iterations,
            budget=6,
            continuations=2,
            group=2,
            prompts=12,
            max_tokens=6,
            eval_tasks=4,
            eval_k=1,
            eval_every=1,
            update=UpdateConfig(lr=1e-2, minibatch=4, skip_flat_paths=False),
            checkpoint_every=1,  # every iteration's policy, for the tests that read them
        ),
        **kwargs,  # type: ignore[arg-type]
    )


# --- comparing two runs' logs ---------------------------------------------------------------
MEASURED = {
    "update": ("peak_gib", "held_gib"),
    "predictor": ("seconds",),
    "storage": ("s3_bytes", "checkpoint_bytes"),
}
"""What the machine measured rather than the run computed: a process's memory, wall times (and
the idle seconds drawn from them), a pipeline step's storage traffic."""


def comparable(records: list[IterationRecord]) -> list[dict[str, object]]:
    """The records without what the machine measured (which phases were timed stays)."""
    out = []
    for record in records:
        body = {**asdict(record), "seconds": sorted(record.seconds), "idle": sorted(record.idle)}
        for field, keys in MEASURED.items():
            body[field] = {k: v for k, v in body[field].items() if k not in keys}
        out.append(body)
    return out


def differences(a: list[IterationRecord], b: list[IterationRecord]) -> list[str]:
    """Where two logs differ: iteration, field, key, the two values."""
    found = []
    for x, y in zip(comparable(a), comparable(b), strict=True):
        for field, value in x.items():
            if value != y[field]:
                keys = sorted(set(value) | set(y[field])) if isinstance(value, dict) else [""]
                for key in keys:
                    mine = value.get(key) if isinstance(value, dict) else value
                    theirs = y[field].get(key) if isinstance(value, dict) else y[field]
                    if mine != theirs:
                        found.append(f"{x['iteration']} {field} {key}: {mine} != {theirs}")
    return found


ROUNDING = {"update": (1e-5, 1e-6)}
"""An engine started anew in between (an empty prefix cache, other batch shapes): its logprobs,
the update's π_old, round apart in the last bits, and the update's figures move by as much."""

ARRIVAL_ORDER = {"predictor": (1e-4, 1e-9)}
"""Engines that answered turns in another order (the continuous driver on Ray actors against
the in-process engine): a tree's node ids follow the order its turns came back, and the
predictor's examples follow the node ids, so its float sums round apart (1e-9 apart for losses
near 0)."""


def same_run_but(
    a: list[IterationRecord], b: list[IterationRecord], close: dict[str, tuple[float, float]]
) -> None:
    """Two logs of one run: the same tokens, rewards and evaluations; the numbers of each field
    in ``close`` within its (relative, absolute) tolerance, everything else equal."""
    import pytest

    mine, theirs = comparable(a), comparable(b)
    assert [{**r, **dict.fromkeys(close)} for r in mine] == [
        {**r, **dict.fromkeys(close)} for r in theirs
    ], differences(a, b)
    for x, y in zip(mine, theirs, strict=True):
        for field, (rel, abs_) in close.items():
            got, want = x[field], y[field]
            assert isinstance(got, dict) and isinstance(want, dict)
            numbers = {k for k, v in want.items() if isinstance(v, float | int)}
            assert {k: v for k, v in got.items() if k not in numbers} == {
                k: v for k, v in want.items() if k not in numbers
            }
            got, want = ({k: f[k] for k in numbers} for f in (got, want))
            assert got == pytest.approx(want, rel=rel, abs=abs_), (x["iteration"], field)


def same_run_but_rounding(a: list[IterationRecord], b: list[IterationRecord]) -> None:
    """Two logs of one run where an engine was started anew in between (``ROUNDING``)."""
    same_run_but(a, b, ROUNDING)


def same_run_but_arrival_order(a: list[IterationRecord], b: list[IterationRecord]) -> None:
    """Two logs of one run whose engines answered turns in other orders (``ARRIVAL_ORDER``)."""
    same_run_but(a, b, ARRIVAL_ORDER)


def same_trees_but_order(mine: list[RolloutTree], theirs: list[RolloutTree]) -> None:
    """Two runs' trees, one for one: the same turns under the same prefixes, tokens, texts,
    rewards and branch marks, whatever order the nodes came back in; the logprobs and the
    predictor's V within float rounding (see ``ROUNDING`` and ``ARRIVAL_ORDER``)."""
    import pytest

    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a.info == b.info and a.size == b.size, (a.info, b.info)
        exact_a, exact_b = (sorted(_nodes(t), key=lambda n: n[0]) for t in (a, b))
        assert [n[0] for n in exact_a] == [n[0] for n in exact_b], a.info
        for (_, lp_a, v_a), (_, lp_b, v_b) in zip(exact_a, exact_b, strict=True):
            assert lp_a == pytest.approx(lp_b, rel=1e-4, abs=1e-5, nan_ok=True), a.info
            assert v_a == pytest.approx(v_b, rel=1e-4, abs=1e-6, nan_ok=True), a.info


def _nodes(tree: RolloutTree) -> list[tuple[tuple[object, ...], list[float], float]]:
    """Each node as (what must be equal, keyed by its path's tokens; logprobs; predicted V)."""
    out = []
    for node in range(tree.size):
        path = tuple(tuple(tree.gen_tokens[i].tolist()) for i in tree.path(node))
        exact = (
            path,
            tuple(tree.obs_tokens[node].tolist()),
            tree.text[node],
            tree.observation[node],
            repr(float(tree.reward[node])),
            bool(tree.branch[node]),
            bool(tree.truncated[node]),
        )
        out.append((exact, tree.logprobs[node].tolist(), float(tree.predicted_v[node])))
    return out


def signature(trees: list[RolloutTree]) -> list[tuple[object, ...]]:
    """What was grown, not when: each tree's prompt, version and turns (the tokens from the
    root to the turn's end, the turn's tokens, its reward), in a canonical order (node ids
    follow the order turns came back, which on engine actors depends on timing)."""
    out: list[tuple[object, ...]] = []
    for tree in trees:
        turns = []
        for node in range(1, len(tree.parent)):
            history = tuple(int(t) for n in tree.path(node)[1:] for t in tree.gen_tokens[int(n)])
            reward = None if math.isnan(tree.reward[node]) else float(tree.reward[node])
            turns.append((history, tuple(tree.gen_tokens[node].tolist()), reward))
        out.append((tree.info.prompt_id, tree.info.policy_version, sorted(turns, key=str)))
    return out
