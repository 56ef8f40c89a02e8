"""The lease a run holds on its trainer actors (``rollout.lease``, as the kept engine actors
hold theirs): detached, they outlive the step that started them, so they must go by themselves
once their run is gone (a failed or cancelled run never reaches close-session).

    @ray.remote
    @leased                                   # every public method renews the lease
    class TrainerRank: ...  # __init__: self._lease = Lease(); self._lease.watch(idle_s, busy)

    with renewing(lambda: trainers.ranks, idle_s):   # a step: renewed while it runs
        ...                                          # (a rollout calls no trainer for minutes)

Every call a step makes to a trainer renews its lease, and while a step runs it renews the
lease in the background (``renewing``), its trainers' and its kept engine actors' (the run's
session, ``train.steps.session``), from the step's start: its waits for the run's placement
group and for the engines to start count as no idle time. A trainer without a call for
``idle_s`` seconds and with nothing running (no call, no checkpoint being written, no wait for
its group's devices) removes its placement group (the run's: the devices it reserved; the
group's other actors go with it) and stops itself, which frees its GPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

UPSTREAM = ("ray.actor.ActorMethod.remote",)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""

T = TypeVar("T")


def leased(cls: type[T]) -> type[T]:
    """``cls`` with each public method run as a call of the instance's ``_lease``."""
    for name, method in list(vars(cls).items()):
        if name.startswith("_") or not callable(method):
            continue
        setattr(cls, name, _renews(method))
    return cls


def _renews(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lease.call():
            return method(self, *args, **kwargs)

    return call


@contextlib.contextmanager
def renewing(actors: Callable[[], Sequence[Any]], idle_s: float) -> Iterator[None]:
    """While the block runs, renew the lease of the actors ``actors()`` returns (a call of
    their ``renew``) every quarter of ``idle_s`` (a minute at most), without waiting for the
    answers; ``idle_s`` <= 0: nothing to renew."""
    if idle_s <= 0:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(60.0, idle_s / 4)):
            for actor in actors():
                with contextlib.suppress(Exception):  # a dead one is the step's to find
                    actor.renew.remote()

    thread = threading.Thread(target=beat, daemon=True, name="trainer-lease")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
