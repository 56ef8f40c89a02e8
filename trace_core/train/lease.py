"""The lease a run holds on its trainer actors: detached, they outlive the step that started them,
so they must go by themselves once their run is gone (a failed or cancelled run never reaches
close-session), as kept engine actors do after ``keep_alive_s`` without a call.

    @ray.remote
    @leased                                   # every public method renews the lease
    class TrainerRank: ...  # __init__: self._lease = Lease(); self._lease.watch(idle_s, busy)

    with renewing(lambda: trainers.ranks, idle_s):   # a step: renewed while it runs
        ...                                          # (a rollout calls no trainer for minutes)

Every call a step makes to a trainer renews its lease, and while a step runs it renews the
lease in the background (``renewing``); a trainer without a call for ``idle_s`` seconds and
with nothing running (no call, no checkpoint being written) removes its placement group (the
devices its group reserved; the group's other trainers go with it) and stops itself, which
frees its GPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import ray

UPSTREAM = (
    "ray.util.get_current_placement_group()",
    "ray.util.remove_placement_group(placement_group, /)",
    "ray.get_runtime_context()",
    "ray.runtime_context.RuntimeContext.current_actor",
    "ray.kill(actor, /, no_restart)",
    "ray.actor.ActorMethod.remote",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""

T = TypeVar("T")


class Lease:
    """An actor's lease: the end of its last call, and how many calls run now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy, self._last = 0, time.monotonic()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """A call, which renews the lease when it ends."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last = time.monotonic()

    def watch(self, idle_s: float, working: Callable[[], bool] = lambda: False) -> None:
        """From now on, stop this actor (and its placement group) after ``idle_s`` seconds
        without a call while ``working()`` is false; ``idle_s`` <= 0: never."""
        if idle_s > 0:
            threading.Thread(target=self._expire, args=(idle_s, working), daemon=True).start()

    def _expire(self, idle_s: float, working: Callable[[], bool]) -> None:
        while True:
            time.sleep(min(idle_s, 5.0))
            with self._lock:
                idle = self._busy == 0 and time.monotonic() - self._last >= idle_s
                if idle and not working():
                    self._busy = 1  # what comes in from now on waits for the end
                    break
        group = ray.util.get_current_placement_group()
        if group is not None:  # its devices, and the group's other actors with them
            ray.util.remove_placement_group(group)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


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
