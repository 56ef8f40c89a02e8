"""An actor's lease: a detached Ray actor outlives the step that started it, so it must go by
itself once its run is gone (a failed or cancelled run never reaches the step that stops it).
Every call renews the lease; an actor without a call for ``idle_s`` seconds, and with nothing
running, removes its placement group (the devices the group reserved; the group's other actors
go with it) and stops itself, which frees its devices. The engine actors
(``rollout.ray_worker``) and the trainer actors (``train.lease``) hold one.

    self._lease = Lease()
    self._lease.watch(idle_s, working=lambda: writing, before_exit=self.shutdown)
    with self._lease.call(): ...          # in every method a caller reaches
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import ray

UPSTREAM = (
    "ray.util.get_current_placement_group()",
    "ray.util.remove_placement_group(placement_group, /)",
    "ray.get_runtime_context()",
    "ray.runtime_context.RuntimeContext.current_actor",
    "ray.kill(actor, /, no_restart)",
)
"""What this module calls in Ray (``policy.upstream``: entry syntax there)."""


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

    def watch(
        self,
        idle_s: float,
        working: Callable[[], bool] = lambda: False,
        before_exit: Callable[[], object] = lambda: None,
    ) -> None:
        """From now on, stop this actor (and its placement group) after ``idle_s`` seconds
        without a call while ``working()`` is false, ``before_exit()`` first; ``idle_s`` <= 0:
        never."""
        if idle_s > 0:
            threading.Thread(
                target=self._expire, args=(idle_s, working, before_exit), daemon=True
            ).start()

    def _expire(
        self, idle_s: float, working: Callable[[], bool], before_exit: Callable[[], object]
    ) -> None:
        while True:
            time.sleep(min(idle_s, 5.0))
            with self._lock:
                idle = self._busy == 0 and time.monotonic() - self._last >= idle_s
                if idle and not working():
                    self._busy = 1  # what comes in from now on waits for the end
                    break
        before_exit()
        group = ray.util.get_current_placement_group()
        if group is not None:  # its devices, and the group's other actors with them
            ray.util.remove_placement_group(group)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
