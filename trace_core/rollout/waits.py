"""Waits on actors, each bounded. An actor that died raises at once, but one alive and stuck (a
hung collective, a deadlocked engine, a node that froze) would hang the run forever; so every
wait on trainer and engine actors goes through ``get`` or ``first`` (``ray.get`` and
``ray.wait`` with a limit), and past the limit one line names who did not answer, for what, the
limit and the setting that sets it::

    stats = get(refs, Wait("trainer ranks", range(2), "update (seed 7)", 3600, "wait_timeout_s"))
    # WaitTimeoutError: trainer ranks [1] did not answer within 3600 s (wait_timeout_s) for
    # update (seed 7): alive but stuck (a hung collective or engine, a frozen node), or the call
    # needs longer: look at their logs, or raise wait_timeout_s

The call itself goes on where it runs: the caller ends the run, or stops the actors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

UPSTREAM = (
    "ray.get(object_refs, /, timeout)",
    "ray.wait(ray_waitables, /, num_returns, timeout)",
    "ray.exceptions.GetTimeoutError",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""


class WaitTimeoutError(RuntimeError):
    """Actors that did not answer a call within its limit: one line naming them, the call, the
    limit and the setting (the CLI prints it as its error; ``--debug`` shows the traceback)."""


@dataclass(frozen=True)
class Wait:
    """What a wait is for: the line it ends in past ``timeout_s``."""

    who: str
    """The kind of actor waited on: ``trainer ranks``, ``engine workers``."""
    names: Iterable[object]
    """Each ref's actor (its rank, its worker number), in the refs' order."""
    what: str
    """The call, with its iteration or call number where known: ``update (seed 7)``."""
    timeout_s: float
    setting: str
    """The setting that sets ``timeout_s``: ``wait_timeout_s``, ``call_timeout_s``."""
    hint: str = ""
    """What to do (default: the stuck actor's causes, and ``setting``)."""
    error: type[Exception] = field(default=WaitTimeoutError)
    """The exception raised (an ``EngineStartError`` for a restarted engine)."""

    def line(self, late: Sequence[object]) -> str:
        hint = self.hint or (
            "alive but stuck (a hung collective or engine, a frozen node), or the call needs "
            f"longer: look at their logs, or raise {self.setting}"
        )
        names = ", ".join(map(str, dict.fromkeys(late)))
        limit = f"{self.timeout_s:g} s ({self.setting})"
        return f"{self.who} [{names}] did not answer within {limit} for {self.what}: {hint}"


def get(refs: Sequence[Any], wait: Wait) -> list[Any]:
    """``ray.get(refs)`` within ``wait.timeout_s``; past it, ``wait.error`` naming the actors
    whose refs are not ready."""
    refs = list(refs)
    try:
        return list(ray.get(refs, timeout=wait.timeout_s))
    except GetTimeoutError:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(done)
        names = list(wait.names)
        late = [n for n, ref in zip(names, refs, strict=True) if ref not in ready]
        raise wait.error(wait.line(late or names)) from None


def first(refs: Sequence[Any], wait: Wait) -> Any:
    """The first of ``refs`` to be ready (not its value), within ``wait.timeout_s``; past it,
    ``wait.error`` naming every actor waited on."""
    done, _ = ray.wait(list(refs), num_returns=1, timeout=wait.timeout_s)
    if not done:
        raise wait.error(wait.line(list(wait.names)))
    return done[0]
