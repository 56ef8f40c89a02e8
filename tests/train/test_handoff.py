"""The pipeline's iterations hand the run's state on through the store
(``trace_core.train.steps.handoff``): published whole or not at all, never replaced once
committed, and an iteration run again after it committed hands on what it wrote."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from trace_core.store.artifacts import open_store
from trace_core.train.contract import PipelineConfig, read_metrics, write_metrics
from trace_core.train.steps.finish import record_trees
from trace_core.train.steps.handoff import (
    committed,
    done_before,
    fetch,
    iterations,
    publish,
    remove_scratch,
    state_uri,
)
from trace_core.train.steps.session import STATE


def a_state(folder: Path, iteration: int) -> Path:
    (folder / "predictor").mkdir(parents=True)
    (folder / "predictor" / "predictor.json").write_text("{}")
    (folder / "log.jsonl").write_text("")
    (folder / STATE).write_text(json.dumps({"iteration": iteration}))
    return folder


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store root: a folder, or a prefix on the test S3 server."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return f"s3://trace/handoff-{uuid.uuid4().hex[:8]}"


def test_a_state_is_published_whole_and_never_replaced(root: str, tmp_path: Path) -> None:
    config = PipelineConfig.from_json(
        json.dumps({"train": {"iterations": 3}, "store": root, "engine_name": "nightly-1a2b3c4d"})
    )
    assert iterations(config, 4) == [5, 6, 7]
    uri = state_uri(config, 5)
    assert uri == f"{root}/sessions/nightly-1a2b3c4d/state-0005"
    with pytest.raises(FileNotFoundError, match=f"{uri}: no state there"):
        fetch(uri, tmp_path / "nothing")
    # What a step that died while publishing left: files without state.json.
    store = open_store(uri)
    store.put_bytes("predictor/stale.bin", b"half")
    assert not committed(uri)
    publish(a_state(tmp_path / "a", 5), uri)
    assert committed(uri)
    assert sorted(o.key for o in store.list_objects()) == [
        "log.jsonl",
        "predictor/predictor.json",
        STATE,
    ]
    with pytest.raises(FileExistsError, match="committed there already"):
        publish(a_state(tmp_path / "b", 5), uri)
    publish(a_state(tmp_path / "c", 6), uri, replace=True)  # open-session's own retry
    got = fetch(uri, tmp_path / "got")
    assert json.loads((got / STATE).read_text()) == {"iteration": 6}


def test_an_iteration_run_again_after_it_committed_hands_on_what_it_wrote(
    root: str, tmp_path: Path
) -> None:
    trees = tmp_path / "kfp" / "iterate" / "trees"  # the first attempt's trees artifact
    write_metrics(trees, {"iteration": 2.0, "tokens": 812.0})
    (trees / "trees.parquet").write_bytes(b"PAR1")
    state = a_state(tmp_path / "state-2", 2)
    record_trees(tmp_path / "state-1", state, 2, str(trees))
    uri = f"{root}/sessions/s/state-0002"
    assert done_before(uri, 2, tmp_path / "retry") is None  # not committed: it runs
    publish(state, uri)
    again = tmp_path / "retry"
    assert done_before(uri, 2, again) == {"iteration": 2.0, "tokens": 812.0}
    assert (again / "trees.parquet").read_bytes() == b"PAR1" and read_metrics(again)
    with pytest.raises(ValueError, match="lists no trees of iteration 3"):
        done_before(uri, 3, tmp_path / "other")


def test_the_runs_scratch_goes_when_it_ends_and_no_other_runs(root: str, tmp_path: Path) -> None:
    """close-session deletes the session's folder but its last state (the report reads it
    after), and its Ray jobs' staging; the exit handler's release deletes the rest. Another
    run's session and jobs, even one whose name begins with this one's, and the registry stay."""
    from trace_core.train.rayjob import is_job_of, new_job_id

    session, other = "nightly-1a2b3c4d", "nightly-1a2b3c4d-x-0f0f0f0f"  # another run_name's
    store = open_store(root)
    mine = [new_job_id(session, step, i) for step, i in (("open-session", 0), ("iterate", 1))]
    theirs = [new_job_id(other, "iterate", 1), "trace-nightly-iterate-0001-0a0b0c0d", "wf-1"]
    assert all(is_job_of(session, job) for job in mine)
    assert not any(is_job_of(session, job) for job in theirs)
    for job in mine + theirs:
        store.put_bytes(f"staging/{job}/in/prompts/train.parquet", b"p")
        store.put_bytes(f"staging/{job}/out/state/state.json", b"{}")
    for name in (session, other):
        for folder in ("state-0000", "trees-0001", "state-0001", "state-0002"):
            store.put_bytes(f"sessions/{name}/{folder}/state.json", b"{}")
        store.put_bytes(f"sessions/{name}/state-0002/predictor/predictor.json", b"{}")
    store.put_bytes("checkpoints/nightly/latest.json", b"{}")
    before = {o.key for o in store.list_objects("")}

    said: list[str] = []
    lines = remove_scratch(root, session, keep="state-0002", say=said.append)
    assert said == lines and len(lines) == 5  # three session folders, two jobs
    assert f"deleted {store.uri(f'staging/{mine[0]}')} (2 objects)" in lines
    left = {o.key for o in store.list_objects("")}
    assert {k for k in before - left if not k.startswith("staging/")} == {
        f"sessions/{session}/{folder}/state.json"
        for folder in ("state-0000", "trees-0001", "state-0001")
    }
    assert {k.split("/")[1] for k in before - left if k.startswith("staging/")} == set(mine)
    assert store.list_objects(f"sessions/{session}") == [
        o for o in store.list_objects("") if o.key.startswith(f"sessions/{session}/state-0002/")
    ]
    # The exit handler's release: the last state too; again, nothing left is no error.
    lines = remove_scratch(root, session, say=said.append)
    assert lines == [f"deleted {store.uri(f'sessions/{session}')} (2 objects)"]
    assert remove_scratch(root, session) == []
    gone = {
        k
        for k in before
        if k.startswith((f"sessions/{session}/", *(f"staging/{j}/" for j in mine)))
    }
    assert {o.key for o in store.list_objects("")} == before - gone
    # A name that would reach outside the session's folder is refused, said in one line.
    (line,) = remove_scratch(root, "../checkpoints", say=lambda _: None)
    assert (
        line.startswith("the scratch of session ../checkpoints in ") and "<run_id>-<8 hex>" in line
    )
    assert {o.key for o in store.list_objects("")} == before - gone
