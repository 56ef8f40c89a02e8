"""``policy.peak``: a block's own peak memory, not the process's since it started."""

from __future__ import annotations

from trace_core.policy.peak import held_bytes, measure_peak

MIB = 2**20


def touched(mib: int) -> bytearray:
    """``mib`` MiB the process really holds (bytearray zero-fills, so every page is touched)."""
    return bytearray(mib * MIB)


def test_a_block_after_a_larger_one_reports_its_own_peak() -> None:
    big = touched(384)
    del big  # freed back to the system: a large block is its own mapping
    with measure_peak("cpu") as peak:
        small = touched(64)
        del small
    assert peak.scope == "block"  # Linux: /proc/self/clear_refs reset the high-water mark
    # The 64 MiB is in the block's peak, the 384 MiB before it is not.
    assert 60 * MIB <= peak.peak - peak.held < 300 * MIB
    assert peak.gib == peak.peak / 2**30 and peak.held_gib == peak.held / 2**30


def test_held_bytes_follow_what_the_process_holds() -> None:
    before = held_bytes("cpu")
    block = touched(128)
    assert held_bytes("cpu") - before >= 120 * MIB
    del block
