"""``LoopThread``: an asyncio event loop on a daemon thread of its own, for a synchronous caller
of an asyncio library (``policy.vllm_engine`` runs vLLM's ``AsyncLLM`` on one).

    loop = LoopThread("vllm")
    value = loop.run(coroutine)          # blocks the caller until it is done
    future = loop.submit(coroutine)      # a concurrent.futures.Future, at once
    loop.close()

Every coroutine runs on the loop's thread, so the library's background tasks (vLLM's output
handler) and the caller's requests share one loop, whichever thread submits them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running forever on a daemon thread until ``close``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=f"{name}-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coroutine`` on the loop; its future answers from any thread."""
        if self.loop.is_closed() or not self._thread.is_alive():
            coroutine.close()
            raise RuntimeError("this event loop is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result (or its exception)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("LoopThread.run called from its own loop: it would wait forever")
        return self.submit(coroutine).result()

    def close(self) -> None:
        """Stop the loop and its thread; tasks still pending are cancelled."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._cancel_all)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()

    def _cancel_all(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()

        async def stop() -> None:  # once every task has taken its cancellation
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        self.loop.create_task(stop())
