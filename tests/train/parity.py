"""The parity task the loop and step tests train on, and their tiny policy's size.

Registered by tests/conftest.py as the module ``trace_train_parity`` (the tests are not a
package).
"""

from __future__ import annotations

from dataclasses import asdict

from trace_core.envs.base import Split, Step, Task
from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig
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


# --- comparing two runs' logs ---------------------------------------------------------------
MEASURED = {"update": ("peak_gib", "held_gib"), "predictor": ("seconds",)}
"""What the machine measured rather than the run computed: a process's memory, wall times."""


def comparable(records: list[IterationRecord]) -> list[dict[str, object]]:
    """The records without what the machine measured (which phases were timed stays)."""
    out = []
    for record in records:
        body = {**asdict(record), "seconds": sorted(record.seconds)}
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


def same_run_but_rounding(a: list[IterationRecord], b: list[IterationRecord]) -> None:
    """Two logs of one run where an engine was started anew in between: the same tokens,
    rewards, predictor and evaluations; the engine's logprobs (the update's π_old) round apart
    in the last bits (an empty prefix cache, other batch shapes), which moves the update's
    figures by as much: those are close (1e-5), everything else equal."""
    import pytest

    mine, theirs = comparable(a), comparable(b)
    assert [{**r, "update": None} for r in mine] == [{**r, "update": None} for r in theirs]
    for x, y in zip(mine, theirs, strict=True):
        update_x, update_y = x["update"], y["update"]
        assert isinstance(update_x, dict) and isinstance(update_y, dict)
        numbers = {k for k, v in update_y.items() if isinstance(v, float | int)}
        assert {k: v for k, v in update_x.items() if k not in numbers} == {
            k: v for k, v in update_y.items() if k not in numbers
        }
        got, want = ({k: u[k] for k in numbers} for u in (update_x, update_y))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (x["iteration"], got, want)


def same_run_but_arrival_order(a: list[IterationRecord], b: list[IterationRecord]) -> None:
    """Two logs of one run whose engines answered turns in other orders (the continuous driver
    on Ray actors against the in-process engine): the same tokens, rewards, update and
    evaluations. A tree's node ids follow the order its turns came back, and the predictor's
    examples follow the node ids, so its float sums round apart: its figures are close
    (1e-4, or 1e-9 apart for losses near 0), everything else equal."""
    import pytest

    mine, theirs = comparable(a), comparable(b)
    assert [{**r, "predictor": None} for r in mine] == [{**r, "predictor": None} for r in theirs]
    for x, y in zip(mine, theirs, strict=True):
        fit_x, fit_y = x["predictor"], y["predictor"]
        assert isinstance(fit_x, dict) and isinstance(fit_y, dict)
        numbers = {k for k, v in fit_y.items() if isinstance(v, float)}
        assert {k: v for k, v in fit_x.items() if k not in numbers} == {
            k: v for k, v in fit_y.items() if k not in numbers
        }
        got, want = ({k: f[k] for k in numbers} for f in (fit_x, fit_y))
        assert got == pytest.approx(want, rel=1e-4, abs=1e-9), (x["iteration"], got, want)
