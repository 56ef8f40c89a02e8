"""``reference.json``: what the load step passes instead of weights (``store.reference``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_core.store.reference import REFERENCE, Reference, read_reference, write_reference


def test_a_reference_round_trips_and_a_bad_one_names_its_file(tmp_path: Path) -> None:
    uri = "s3://trace/checkpoints/run/iter-000005-ab12cd34/policy"
    write_reference(tmp_path / "policy", Reference(uri, 5))
    assert read_reference(tmp_path / "policy") == Reference(uri, 5)
    assert read_reference(f"file://{tmp_path}/policy") == Reference(uri, 5)
    assert read_reference(tmp_path) is None  # a folder of data, not a reference
    # A local target: absolute, as a path (file:// too); a relative one names nothing elsewhere.
    write_reference(tmp_path / "base", Reference(f"file://{tmp_path}/model"))
    assert read_reference(tmp_path / "base") == Reference(f"{tmp_path}/model", 0)
    with pytest.raises(ValueError, match="'models/base': give an s3:// URI or an absolute path"):
        write_reference(tmp_path / "relative", Reference("models/base"))
    assert not (tmp_path / "relative").exists()
    bad = {
        "not JSON": ("{", "not valid JSON"),
        "another kind": ('{"kind": "trace.run-state"}', "kind must be 'trace.reference'"),
        "a relative uri": ('{"kind": "trace.reference", "uri": "x"}', "field 'uri' must be"),
        "a bad iteration": (
            '{"kind": "trace.reference", "uri": "s3://b/p", "iteration": -1}',
            "field 'iteration' must be an integer >= 0",
        ),
        "a field too many": (
            '{"kind": "trace.reference", "uri": "s3://b/p", "weights": 1}',
            "unknown field",
        ),
    }
    for case, (text, message) in bad.items():
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / REFERENCE).write_text(text)
        with pytest.raises(ValueError, match=message) as err:
            read_reference(tmp_path / "bad")
        assert str(err.value).startswith(f"{tmp_path / 'bad' / REFERENCE}: "), case
