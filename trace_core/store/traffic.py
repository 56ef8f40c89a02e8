"""The bytes this process moves to and from object storage: one counter, ``TRAFFIC``, that every
``S3Store`` adds to (``trace_core.store.artifacts``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class Traffic:
    """Bytes this process moved to and from object storage (``S3Store``), for the benchmarks
    and the steps' metrics. What a thread moves inside ``checkpoint()`` also counts, apart, as
    checkpoint bytes (a checkpoint uploaded in the background is then told from the rest)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.read = self.written = self.checkpoint_bytes = 0

    def add(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written
            if getattr(self._local, "checkpoint", False):
                self.checkpoint_bytes += read + written

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.read, self.written

    def counts(self) -> tuple[int, int, int]:
        """Bytes read, written, and of those, moved inside ``checkpoint()``."""
        with self._lock:
            return self.read, self.written, self.checkpoint_bytes

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[None]:
        """This thread's transfers inside count as checkpoint bytes too."""
        self._local.checkpoint = True
        try:
            yield
        finally:
            self._local.checkpoint = False


TRAFFIC = Traffic()
"""Every ``S3Store`` of this process counts into it (minio transfers; Parquet written through
pyarrow's own S3 client is not counted)."""


class MinioProgress:
    """The progress object ``minio`` expects, forwarding the bytes read so far."""

    def __init__(self, callback: Callable[[int], None]) -> None:
        self.callback = callback
        self.sent = 0

    def set_meta(self, object_name: str, total_length: int) -> None:
        self.sent = 0

    def update(self, size: int) -> None:
        self.sent += size
        self.callback(self.sent)
