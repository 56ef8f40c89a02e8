"""``trace-rl bench store``, tiny: the keys of its JSON, locally and on a SeaweedFS it starts.

Nothing here asserts on speed; the ratios only have to be present, finite and positive (the
bench itself checks that every file read back equals the table written).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_core.bench.store import sim_trees, tile
from trace_core.store.schema import from_table, to_table

KEYS = (
    "size_ratio_jsonl_over_parquet",
    "read_speedup_parquet_over_jsonl",
    "query_seconds_1m_nodes",
)


def test_tile_keeps_trees_distinct() -> None:
    table = to_table(sim_trees(5))
    big = tile(table, 3 * table.num_rows - 1)
    assert big.num_rows == 3 * table.num_rows
    assert len(from_table(big)) == 15


@pytest.mark.cluster  # the bench starts a SeaweedFS server
def test_bench_store_command(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("trace-rl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trace_core.cli"]
    out = subprocess.run(
        [
            *command,
            "bench",
            "store",
            "--trees",
            "40",
            "--query-nodes",
            "5000",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "store.json"),
        ],
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "store.json").read_text())
    for block in (result, result["s3"]):
        for key in KEYS:
            assert math.isfinite(block[key]) and block[key] > 0, (key, block)
    assert result["varied"]["size_ratio_jsonl_over_parquet"] > 1
    assert {(r["where"], r["data"]) for r in result["formats"]} == {
        ("local", "sim"),
        ("local", "varied"),
        ("s3", "sim"),
    }
    assert all(q["nodes"] >= 5000 and q["rows"] > 0 for q in result["queries"])
    assert "SeaweedFS" in " ".join(result["notes"])
    assert "query (s3)" in out.stdout
