"""The lease of a run's detached actors (``rollout.lease``, ``train.lease``), on short idle
limits and without Ray: an idle actor stops, a call, a checkpoint being written or a placement
group waiting for its devices holds it (and the idle time starts again when they end), and a
running step's renewal keeps it alive however long it waits; the wait for a placement group says
what is pending at its interval."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from trace_core.rollout import placement
from trace_core.rollout.lease import Lease
from trace_core.train.lease import renewing

IDLE_S = 0.3


class Watched:
    """A lease watched on ``IDLE_S``, with a switch for what holds it, and when it stopped."""

    def __init__(self) -> None:
        self.lease, self.holding = Lease(), False
        self.stopped: float | None = None
        self.exits: list[str] = []
        self.lease.watch(
            IDLE_S,
            before_exit=lambda: self.exits.append("before"),
            pending=lambda: self.holding,
            stop=self._stop,
        )

    def _stop(self) -> None:
        self.stopped = time.monotonic()

    def wait_stopped(self, within_s: float = 5.0) -> float:
        deadline = time.monotonic() + within_s
        while self.stopped is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.stopped is not None, "the lease did not run out"
        return self.stopped


def test_an_idle_actor_stops_after_its_limit() -> None:
    start = time.monotonic()
    watched = Watched()
    stopped = watched.wait_stopped()
    assert IDLE_S <= stopped - start < IDLE_S + 2.0
    assert watched.exits == ["before"]  # its engine first, then the actor and its group


def test_a_call_in_flight_holds_the_lease_and_its_end_renews_it() -> None:
    watched = Watched()
    with watched.lease.call():
        time.sleep(4 * IDLE_S)
        assert watched.stopped is None
    ended = time.monotonic()
    assert watched.wait_stopped() - ended >= IDLE_S


def test_a_placement_group_waiting_for_its_devices_does_not_count_as_idle() -> None:
    """Pods Pending while nodes come up: however long the wait (here 5 idle limits), the lease
    holds, and the idle time starts when the group is placed."""
    watched = Watched()
    watched.holding = True
    time.sleep(5 * IDLE_S)
    assert watched.stopped is None
    watched.holding = False
    placed = time.monotonic()
    # From the last look that saw it waiting (a look every IDLE_S here, every 5 s at most).
    assert placed < watched.wait_stopped() < placed + IDLE_S + 1.0


def test_a_lease_that_ran_out_makes_later_calls_wait_for_the_end() -> None:
    lease = Lease()
    assert not lease.expired(10.0, holding=False)  # just renewed
    assert lease.expired(0.0, holding=False)
    assert not lease.expired(0.0, holding=False)  # once: the actor is stopping
    assert not Lease().expired(0.0, holding=True)  # holding renews it


class Actor:
    """A detached actor's handle as ``renewing`` sees it: ``renew.remote()`` is a call of its
    lease (``TrainerRank.renew``, ``EngineWorker.renew``)."""

    def __init__(self, watched: Watched) -> None:
        self.watched, self.renewals = watched, 0
        self.renew = self

    def remote(self) -> None:
        self.renewals += 1
        with self.watched.lease.call():
            pass


def test_a_running_step_renews_its_actors_while_it_waits_however_long() -> None:
    """The step's renewal (a quarter of the limit apart) keeps an actor alive through a wait of
    5 idle limits (the open-session step waiting for a placement group, say); the actors are
    read at every beat, so one the step starts during the wait is renewed too; once the step
    ends, its actors run out."""
    first = Watched()
    actors: list[Actor] = [Actor(first)]
    with renewing(lambda: actors, IDLE_S):
        time.sleep(2 * IDLE_S)
        second = Watched()  # an actor the step starts while it waits
        actors.append(Actor(second))
        time.sleep(3 * IDLE_S)
        assert first.stopped is None and second.stopped is None
    ended = time.monotonic()
    assert actors[0].renewals >= 10 and actors[1].renewals >= 5  # every 0.075 s
    # The last renewal was at most a beat before the end.
    assert min(first.wait_stopped(), second.wait_stopped()) - ended >= IDLE_S - 0.1


def test_without_a_limit_nothing_is_renewed() -> None:
    calls: list[int] = []
    with renewing(lambda: calls.append(1) or [], 0.0):  # type: ignore[func-returns-value]
        time.sleep(0.1)
    assert calls == []


class Group:
    """A placement group that is placed after ``waits`` waits of its own; like Ray's, it waits
    in whole seconds, on ``clock`` (the test's: nothing sleeps)."""

    def __init__(self, waits: int, clock: list[float]) -> None:
        self.waits, self.clock, self.asked = waits, clock, []

    def wait(self, timeout_s: int) -> bool:
        assert isinstance(timeout_s, int)  # Ray would drop a fraction: 0.5 returns at once
        self.asked.append(timeout_s)
        self.waits -= 1
        if self.waits >= 0:
            self.clock[0] += timeout_s  # as if it waited that long
        return self.waits < 0


def test_the_wait_for_a_placement_group_says_what_is_pending_at_its_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A line after each ``every_s`` of waiting, in whole seconds (one at least); past the
    timeout, False; without a listener, one wait for the whole timeout."""

    def line(group: Any, what: str, waited: float, timeout: float, setting: str, kinds: Any) -> str:
        return f"{what}: {timeout:g} s ({setting})"

    clock = [0.0]
    monkeypatch.setattr(placement, "pending_line", line)
    monkeypatch.setattr(placement, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    lines: list[str] = []
    group = Group(3, clock)
    assert placement.wait_placed(group, 600.0, "the run r", say=lines.append, every_s=60.0)  # type: ignore[arg-type]
    assert lines == ["the run r: 600 s (ready_timeout_s)"] * 3
    assert group.asked == [60, 60, 60, 60]
    lines.clear()
    late = Group(100, clock)
    assert not placement.wait_placed(late, 150.5, "r", say=lines.append, every_s=60.0)  # type: ignore[arg-type]
    assert late.asked == [60, 60, 31] and len(lines) == 2, (late.asked, lines)
    short = Group(100, clock)
    assert not placement.wait_placed(short, 0.4, "r", say=lines.append, every_s=0.1)  # type: ignore[arg-type]
    assert short.asked == [1]  # never a wait of 0 s, which would spin
    quiet = Group(0, clock)
    assert placement.wait_placed(quiet, 1800.0, "r")  # type: ignore[arg-type]
    assert quiet.asked == [1800]


def test_a_lease_watcher_is_a_daemon_thread() -> None:
    before = {t.ident for t in threading.enumerate()}
    Lease().watch(60.0, pending=lambda: False, stop=lambda: None)
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert started and all(t.daemon for t in started)  # it never holds a process open
