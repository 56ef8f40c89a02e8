"""``IsolatedCall``: answers come back, errors come back as text, and a call past its bound
has its process killed (a fresh one serves the next call). Standard-library functions stand
in for the checks: the child imports what it calls by name."""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trace_core.envs.base import ToolTimeout
from trace_core.envs.isolated import IsolatedCall, IsolatedError

pytestmark = pytest.mark.slow  # spawns Python processes (≈1 s each)


@pytest.fixture
def call() -> Iterator[IsolatedCall]:
    isolated = IsolatedCall(seconds=1.0)
    yield isolated
    isolated.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_one_child_answers_every_call(call: IsolatedCall) -> None:
    assert call(operator.add, 2, 3) == 5
    pid = call.pid
    assert call(operator.mul, 4, 5) == 20
    assert call.pid == pid and pid != os.getpid()


def test_an_error_comes_back_as_text_and_the_child_stays(call: IsolatedCall) -> None:
    assert call(operator.add, 1, 1) == 2
    pid = call.pid
    with pytest.raises(IsolatedError, match="ValueError: invalid literal for int"):
        call(int, "x")
    assert call.pid == pid


def test_a_call_past_its_bound_is_killed_not_abandoned(call: IsolatedCall) -> None:
    assert call(operator.add, 1, 1) == 2
    pid = call.pid
    assert pid is not None
    with pytest.raises(ToolTimeout, match="exceeded 1 s; its process was stopped"):
        call(time.sleep, 60)
    assert call.pid is None and not alive(pid)  # nothing left running the sleep
    assert call(operator.add, 2, 2) == 4 and call.pid != pid


def test_a_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="seconds must be > 0"):
        IsolatedCall(0)


def test_a_slow_start_is_not_counted_in_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child imports ``preload`` (here a module that takes 2 s, as sympy may on a loaded
    machine) before the first call is timed: a 0.5 s bound still holds for the call itself."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(2.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned child gets the parent's sys.path
    isolated = IsolatedCall(seconds=0.5, preload=("slow_to_import",))
    try:
        assert isolated(operator.add, 2, 3) == 5
        with pytest.raises(ToolTimeout):
            isolated(time.sleep, 2.0)
    finally:
        isolated.close()
