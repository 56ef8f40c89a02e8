"""Calls that may run away, made in a child process that is killed when they do.

    checker = IsolatedCall(seconds=5.0, preload=("math_verify",))
    checker(verify_answer, given, gold)     # a module-level function and picklable arguments

``bounded_call`` (``envs.base``) stops waiting for a call after its time bound, but cannot stop
the call: a thread cannot be killed, so a runaway computation (sympy on ``x^x^x^...``) keeps a
core busy for as long as it runs. Here the call runs in one long-lived child process; past the
bound the child is killed and the next call starts a fresh one. A call that returns costs one
round trip through a pipe; the child is started (and its imports paid) once, on first use. The
bound is the call's alone: a child imports ``preload`` and says it is ready before the first
call is timed, so a slow start on a loaded machine (seconds to import sympy) is no timeout.

The child is spawned, not forked: the parent may hold threads (torch's, Ray's), and a forked
copy of a threaded process can deadlock.
"""

from __future__ import annotations

import importlib
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TypeVar

from trace_core.envs.base import ToolTimeout

T = TypeVar("T")

START_SECONDS = 300.0
"""How long a child may take to start and import ``preload`` (not part of any call's bound)."""
READY = "ready"


class IsolatedError(Exception):
    """The call raised in the child; the message is the child's exception, as text."""


def _serve(conn: Connection, preload: tuple[str, ...] = ()) -> None:
    """The child: import ``preload``, say it is ready, then call what arrives and send back
    (True, result) or (False, error text)."""
    for name in preload:
        importlib.import_module(name)
    conn.send(READY)
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            conn.send((True, fn(*args)))
        except Exception as err:  # reported to the parent, which decides
            conn.send((False, f"{type(err).__name__}: {err}"))


class IsolatedCall:
    """One child process for calls bounded by ``seconds`` each (module docstring)."""

    def __init__(self, seconds: float, preload: tuple[str, ...] = ()) -> None:
        """``preload``: modules the child imports before its first call is timed (the
        called function's own module among them, if importing it is slow)."""
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        self.seconds = seconds
        self.preload = preload
        self._lock = threading.Lock()  # one call at a time through the pipe
        self._child: BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid (None before the first call and after a kill)."""
        return self._child.pid if self._child is not None else None

    def __call__(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the child; ``ToolTimeout`` past the bound (the child is killed),
        ``IsolatedError`` if it raised there."""
        with self._lock:
            conn = self._start()
            conn.send((fn, args))
            if not conn.poll(self.seconds):
                self._kill()
                raise ToolTimeout(f"call exceeded {self.seconds:g} s; its process was stopped")
            try:
                ok, value = conn.recv()
            except EOFError:  # the child died (out of memory, a crash in C code)
                self._kill()
                raise IsolatedError("the call's process exited without an answer") from None
            if not ok:
                raise IsolatedError(value)
            return value  # type: ignore[no-any-return]

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _start(self) -> Connection:
        if self._child is not None and self._child.is_alive() and self._conn is not None:
            return self._conn
        self._kill()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._child = context.Process(target=_serve, args=(child, self.preload), daemon=True)
        self._child.start()
        child.close()
        self._conn = parent
        try:
            ready = parent.poll(START_SECONDS) and parent.recv() == READY
        except EOFError:
            ready = False
        if not ready:
            self._kill()
            raise IsolatedError(f"the call's process did not start within {START_SECONDS:g} s")
        return parent

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
        if self._conn is not None:
            self._conn.close()
        self._child, self._conn = None, None
