"""The peak memory of one block of work, measured (the estimate is ``policy.memory``).

    with measure_peak(device) as peak:
        update_policy(...)
    peak.gib, peak.held_gib   # the block's high-water mark; what was held when it began

On CUDA the peak is ``torch.cuda.max_memory_allocated`` after resetting CUDA's counter at the
start. On CPU it is the process's peak resident set (``VmHWM``) after resetting the kernel's
high-water mark through ``/proc/self/clear_refs`` (Linux ≥ 4.0), so a block that follows a
larger one (a rollout before an update) reports its own peak. Where the mark cannot be reset
(not Linux, or the file is not writable) the peak is the process's since it started, and
``Peak.scope`` says ``"process"``.

On CPU, memory a block freed is not always handed back to the system: glibc's malloc keeps
freed heap pages when a live allocation sits above them, so after one update a process can
hold several GB of activations it no longer uses (measured on SmolLM2: 6.7 GiB resident after
an update whose live tensors were under 2 GiB, 2.5 GiB after a trim). ``release_freed_memory``
hands them back (``malloc_trim``); the update calls it before it starts (the rollout's
freed pages) and when it ends (its own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_core.policy.memory import GIB

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class Peak:
    held: int = 0
    """Bytes held when the block began (RSS on CPU, allocated on CUDA)."""
    peak: int = 0
    """The block's high-water mark in bytes."""
    scope: str = "block"
    """``block``: the mark was reset at the start; ``process``: it could not be."""

    @property
    def gib(self) -> float:
        return self.peak / GIB

    @property
    def held_gib(self) -> float:
        return self.held / GIB


@contextmanager
def measure_peak(device: torch.device | str = "cpu") -> Iterator[Peak]:
    """Measure the peak memory of the ``with`` block on ``device``; read it after the block."""
    peak = Peak()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        peak.held = held_bytes(device)
        yield peak
        torch.cuda.synchronize()
        peak.peak = torch.cuda.max_memory_allocated()
        return
    peak.scope = "block" if _reset_high_water_mark() else "process"
    peak.held = held_bytes(device)
    yield peak
    peak.peak = peak_rss_bytes()


def held_bytes(device: torch.device | str = "cpu") -> int:
    """What is held now: CUDA's allocated bytes, or the process's resident set on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated()
    with Path("/proc/self/statm").open() as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """The process's peak resident set since its high-water mark was last reset."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match:
        return int(match.group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # 5: reset the peak RSS to the current RSS
    except OSError:
        return False
    return True


def release_freed_memory() -> bool:
    """Return the heap pages the C allocator holds free to the system (glibc's
    ``malloc_trim(0)``); False where there is no glibc. What is live is not touched."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once (``find_library`` may run ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None
