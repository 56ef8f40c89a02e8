"""Opening dataset files by path or URI, and reading their rows by extension."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trace_core.envs.source import local_path, open_source, read_records, source_format

ROWS = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]


def test_local_paths_and_file_uris_read_the_same_bytes(tmp_path: Path) -> None:
    path = tmp_path / "my data.json"
    path.write_text("[]")
    assert open_source(str(path)) == b"[]"
    assert open_source(path.as_uri()) == b"[]"  # file:///.../my%20data.json
    assert open_source(f"file://localhost{path}") == b"[]"
    assert local_path(path.as_uri()) == path


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("https://example.com/train.json", "unsupported URI scheme 'https'"),
        ("file://otherhost/data.json", "must name a local file"),
    ],
)
def test_other_locations_are_refused_clearly(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_source(uri)
    with pytest.raises(ValueError, match=message):
        read_records(uri)


@pytest.mark.parametrize("uri", ["s3://bucket/data/train.jsonl", "S3://bucket/train.json"])
def test_s3_goes_through_the_store_and_needs_credentials(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real S3 round trip is in tests/store/test_artifacts.py (SeaweedFS on 127.0.0.1).
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PermissionError, match="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        open_source(uri)
    with pytest.raises(PermissionError, match="no S3 credentials"):
        read_records(uri)
    with pytest.raises(ValueError, match="not a local file"):
        local_path(uri)


def test_missing_file_names_the_uri(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.json: no such file"):
        read_records(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    ("uri", "fmt"),
    [
        ("a/b.json", "json"),
        ("a/B.JSONL", "jsonl"),
        ("file:///a/b.parquet", "parquet"),
        ("s3://bucket/k.parquet", "parquet"),
    ],
)
def test_format_comes_from_the_extension(uri: str, fmt: str) -> None:
    assert source_format(uri) == fmt


@pytest.mark.parametrize(
    ("uri", "shown"), [("a/b.csv", "'.csv'"), ("a/b", "'(no extension)'"), ("b.json.gz", "'.gz'")]
)
def test_unknown_extensions_are_refused(uri: str, shown: str) -> None:
    pattern = rf"unknown dataset format {re.escape(shown)}.*\.json.*\.jsonl"
    with pytest.raises(ValueError, match=pattern):
        source_format(uri)


def test_read_records_in_every_format(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    for name in ("d.json", "d.jsonl", "d.parquet"):
        assert read_records(str(tmp_path / name)) == ROWS


def test_malformed_files_say_where(tmp_path: Path) -> None:
    (tmp_path / "obj.json").write_text('{"problem": "p"}')
    with pytest.raises(ValueError, match="expected a JSON list of objects, got dict"):
        read_records(str(tmp_path / "obj.json"))
    (tmp_path / "bad.json").write_text("[1,\n 2,,]")
    with pytest.raises(ValueError, match=r"not valid JSON .* line 2"):
        read_records(str(tmp_path / "bad.json"))
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_records(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_records(str(tmp_path / "bad.parquet"))
    (tmp_path / "latin.json").write_bytes(b'["caf\xe9"]')
    with pytest.raises(ValueError, match="not UTF-8"):
        read_records(str(tmp_path / "latin.json"))
