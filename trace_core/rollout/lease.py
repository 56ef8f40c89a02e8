"""An actor's lease: a detached Ray actor outlives the step that started it, so it must go by
itself once its run is gone (a failed or cancelled run never reaches the step that stops it).
Every call renews the lease; an actor without a call for ``idle_s`` seconds, and with nothing
running, removes its placement group (the devices the group reserved: the run's group, whose
other actors go with it) and stops itself, which frees its devices. The engine actors
(``rollout.ray_worker``) and the trainer actors (``train.lease``) hold one.

    self._lease = Lease()
    self._lease.watch(idle_s, working=lambda: writing, before_exit=self.shutdown)
    with self._lease.call(): ...          # in every method a caller reaches

Time spent waiting for devices does not count: while ``working()`` holds (a checkpoint being
written) or the actor's placement group is not placed whole (``placement_pending``: some of its
bundles wait for a node, as when a node was lost and its pod is Pending while the autoscaler
brings up another), the lease is renewed: the idle time counts from the last look that saw it
(a look every ``idle_s``, 5 s at most). The run's steps renew it from the driver too, the whole
time they run, their waits for devices included (``train.lease.renewing``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import ray

UPSTREAM = (
    "ray.is_initialized()",
    "ray.util.get_current_placement_group()",
    "ray.util.placement_group_table(placement_group, /)",
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
        pending: Callable[[], bool] | None = None,
        stop: Callable[[], object] | None = None,
    ) -> None:
        """From now on, stop this actor (and its placement group) after ``idle_s`` seconds
        without a call, ``before_exit()`` first; ``idle_s`` <= 0: never. While ``working()`` or
        ``pending()`` (default: ``placement_pending``) holds, the lease is renewed. ``stop``:
        how it stops (default: ``stop_actor``; a test's own)."""
        if idle_s > 0:
            threading.Thread(
                target=self._expire,
                args=(idle_s, working, before_exit, pending or placement_pending, stop),
                daemon=True,
            ).start()

    def expired(self, idle_s: float, holding: bool) -> bool:
        """One look at the lease: ``holding`` renews it; True once it ran out (no call for
        ``idle_s`` seconds, none running, nothing holding it), after which calls coming in
        wait for the actor's end."""
        with self._lock:
            now = time.monotonic()
            if holding:
                self._last = now
                return False
            if self._busy == 0 and now - self._last >= idle_s:
                self._busy = 1  # what comes in from now on waits for the end
                return True
            return False

    def _expire(
        self,
        idle_s: float,
        working: Callable[[], bool],
        before_exit: Callable[[], object],
        pending: Callable[[], bool],
        stop: Callable[[], object] | None,
    ) -> None:
        while True:
            time.sleep(min(idle_s, 5.0))
            holding = working()
            if not holding:
                with contextlib.suppress(Exception):  # the GCS out of reach: it counts
                    holding = pending()
            if self.expired(idle_s, holding):
                break
        before_exit()
        (stop or stop_actor)()


def placement_pending() -> bool:
    """Whether this actor's placement group is not placed whole: PENDING, or RESCHEDULING
    (a node of it was lost; its bundles wait for another). False outside a group or Ray."""
    if not ray.is_initialized():
        return False
    group = ray.util.get_current_placement_group()
    if group is None:
        return False
    state = (ray.util.placement_group_table(group) or {}).get("state", "CREATED")
    return state in ("PENDING", "PREPARED", "RESCHEDULING")


def stop_actor() -> None:
    """Remove this actor's placement group (its devices, and the group's other actors with
    them), then stop the actor."""
    group = ray.util.get_current_placement_group()
    if group is not None:  # its devices, and the group's other actors with them
        ray.util.remove_placement_group(group)
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
