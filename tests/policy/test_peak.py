"""``policy.peak``: a block's own peak memory, not the process's since it started."""

from __future__ import annotations

import json
import subprocess
import sys

from trace_core.policy.peak import held_bytes

MIB = 2**20


def touched(mib: int) -> bytearray:
    """``mib`` MiB the process really holds (bytearray zero-fills, so every page is touched)."""
    return bytearray(mib * MIB)


LATER_SMALLER_BLOCK = """
import json
from trace_core.policy.peak import measure_peak
MIB = 2**20
big = bytearray(384 * MIB)
del big  # freed back to the system: a block this large is its own mapping
with measure_peak("cpu") as peak:
    small = bytearray(64 * MIB)
    del small
print(json.dumps({"held": peak.held, "peak": peak.peak, "scope": peak.scope,
                  "gib": peak.gib, "held_gib": peak.held_gib}))
"""


def run_fresh(script: str) -> dict[str, object]:
    """``script``'s JSON line, run in a fresh process: what a heap holds, and whether a new
    allocation touches new pages, depends on what the process did before."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_block_after_a_larger_one_reports_its_own_peak() -> None:
    rss = run_fresh(LATER_SMALLER_BLOCK)
    assert rss["scope"] == "block"  # Linux: /proc/self/clear_refs reset the high-water mark
    # The 64 MiB is in the block's peak, the 384 MiB before it is not.
    grown = rss["peak"] - rss["held"]  # type: ignore[operator]
    assert 60 * MIB <= grown < 300 * MIB
    assert rss["gib"] == rss["peak"] / 2**30  # type: ignore[operator]


def test_held_bytes_follow_what_the_process_holds() -> None:
    before = held_bytes("cpu")
    block = touched(128)
    assert held_bytes("cpu") - before >= 120 * MIB
    del block


FRAGMENTED_HEAP = """
import json, torch
from trace_core.policy.peak import held_bytes, release_freed_memory
MIB = 2**20
block = torch.ones(8 * MIB // 4)  # a freed 8 MiB block raises glibc's mmap threshold, so
del block                         # the 1 MiB tensors below come from the heap
start = held_bytes()
pairs = [(torch.ones(MIB // 4), torch.ones(64)) for _ in range(256)]
kept = [small for _, small in pairs]
del pairs
held = held_bytes()
released = release_freed_memory()
print(json.dumps({"start": start, "held": held, "after": held_bytes(), "released": released,
                  "kept": all(float(t.sum()) == 64.0 for t in kept)}))
"""


def test_freed_memory_below_a_live_allocation_is_handed_back() -> None:
    # In a fresh process (a heap without holes from other tests): 256 MiB of 1 MiB tensors,
    # each followed by a small one that stays alive. Freeing the large ones leaves holes the
    # heap cannot shrink past, so the process still holds them until they are handed back.
    rss = run_fresh(FRAGMENTED_HEAP)
    assert rss["held"] - rss["start"] > 200 * MIB  # freed, still held
    assert rss["released"] and rss["held"] - rss["after"] > 200 * MIB  # handed back
    assert rss["kept"]  # the live tensors are as they were
