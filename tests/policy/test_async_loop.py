"""``LoopThread``: an event loop on a thread of its own, driven from synchronous callers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from trace_core.policy.async_loop import LoopThread


async def _twice(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


async def _thread_name() -> str:
    return threading.current_thread().name


async def _fail() -> None:
    raise KeyError("lost")


def test_coroutines_run_on_the_loops_thread_and_answer_any_caller() -> None:
    loop = LoopThread("test")
    try:
        assert loop.run(_twice(21)) == 42
        assert loop.run(_thread_name()) == "test-loop"
        futures = [loop.submit(_twice(i)) for i in range(5)]
        assert [f.result(timeout=5) for f in futures] == [0, 2, 4, 6, 8]
        with pytest.raises(KeyError, match="lost"):
            loop.run(_fail())
    finally:
        loop.close()


def test_close_cancels_what_is_pending_and_refuses_more() -> None:
    loop = LoopThread("test")
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    pending = loop.submit(forever())
    assert started.wait(timeout=5)
    loop.close()
    assert pending.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(_twice(1))
    loop.close()  # twice is harmless


def test_run_from_the_loops_own_thread_is_refused_instead_of_hanging() -> None:
    loop = LoopThread("test")

    async def nested() -> None:
        loop.run(_twice(1))

    try:
        with pytest.raises(RuntimeError, match="from its own loop"):
            loop.run(nested())
    finally:
        loop.close()
