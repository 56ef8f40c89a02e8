"""The checkpoint registry: ``latest`` moves only after a checkpoint is complete, even when the
S3 server is killed in the middle of an upload (a real SeaweedFS, SIGKILLed and restarted)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trace_core.algo.tree import RolloutTree
from trace_core.store.artifacts import (
    LocalStore,
    ObjectNotFound,
    RetryPolicy,
    S3Store,
    StoreError,
    StoreUnavailable,
)
from trace_core.store.registry import CheckpointRegistry
from trace_core.store.server import SeaweedServer
from trace_core.store.treeset import read_tree_set, write_tree_set

StoreOn = Callable[[SeaweedServer, str, RetryPolicy | None], S3Store]
BIG = 24 << 20  # a "weights" file of 24 MiB: five multipart parts of 5 MiB


def checkpoint_dir(path: Path, version: int, big: int = 0) -> Path:
    (path / "tokenizer").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"version": version}))
    (path / "tokenizer" / "vocab.txt").write_text(f"vocab {version}\n")
    if big:
        (path / "model.safetensors").write_bytes(os.urandom(big))
    return path


def same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files
    )


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.cluster  # a SeaweedFS server
def test_save_latest_download(where: str, tmp_path: Path, bucket_store: S3Store) -> None:
    store = LocalStore(tmp_path / "store") if where == "local" else bucket_store
    registry = CheckpointRegistry(store)
    assert registry.latest("nightly") is None
    v1 = checkpoint_dir(tmp_path / "v1", 1)
    v2 = checkpoint_dir(tmp_path / "v2", 2)
    first = registry.save("nightly", 1, v1, metadata={"policy_version": "1"})
    registry.save("nightly", 2, v2)
    latest = registry.latest("nightly")
    assert latest is not None and latest.iteration == 2
    assert [c.iteration for c in registry.checkpoints("nightly")] == [1, 2]
    assert registry.checkpoints("nightly")[0].metadata == {"policy_version": "1"}
    registry.load_latest("nightly", tmp_path / "resume")
    assert same_files(tmp_path / "resume", v2)
    registry.download(first, tmp_path / "old")
    assert same_files(tmp_path / "old", v1)
    assert registry.latest("other-run") is None  # runs are separate


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    registry = CheckpointRegistry(store)
    with pytest.raises(ValueError, match="run name 'a/b'"):
        registry.save("a/b", 1, checkpoint_dir(tmp_path / "v", 1))
    with pytest.raises(ObjectNotFound, match=r"checkpoints/nightly/latest\.json: run 'nightly'"):
        registry.load_latest("nightly", tmp_path / "x")
    checkpoint = registry.save("nightly", 1, tmp_path / "v")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        registry.download(checkpoint, tmp_path / "full")
    # Tampered content is caught, and nothing half-written is left at the target.
    (tmp_path / "store" / checkpoint.key / "config.json").write_text('{"version": 666}')
    with pytest.raises(StoreError, match=r"config\.json: content differs from its manifest"):
        registry.download(checkpoint, tmp_path / "resume")
    assert not (tmp_path / "resume").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".resume")]


def test_a_damaged_latest_falls_back_and_a_lost_pointer_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    registry = CheckpointRegistry(store)
    first = registry.save("nightly", 1, checkpoint_dir(tmp_path / "v1", 1, big=100))
    second = registry.save("nightly", 2, checkpoint_dir(tmp_path / "v2", 2, big=100))
    # A file of the newest checkpoint is cut short: the one before it is used, and said so.
    (tmp_path / "store" / second.key / "model.safetensors").write_bytes(b"cut")
    said: list[str] = []
    latest = registry.latest("nightly", say=said.append)
    assert latest is not None and latest.key == first.key
    assert said == [
        f"{store.uri(second.key)} is incomplete ({store.uri(second.key)}/model.safetensors has "
        f"3 bytes, not 100); using {first.key.rsplit('/', 1)[-1]}, the newest complete checkpoint"
    ]
    # Without latest.json, a new run under the same name is refused: it would register over it.
    (tmp_path / "store/checkpoints/nightly/latest.json").unlink()
    with pytest.raises(
        ValueError, match=r"latest\.json is missing, but run 'nightly' holds 2 saved"
    ):
        registry.latest("nightly")
    (tmp_path / "store/checkpoints/nightly/latest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"not valid JSON.*checkpoints are kept"):
        registry.latest("nightly")
    # A save that crashed before its manifest blocks nothing.
    (tmp_path / "store/checkpoints/fresh/iter-000001-abc/model.safetensors").parent.mkdir(
        parents=True
    )
    (tmp_path / "store/checkpoints/fresh/iter-000001-abc/model.safetensors").write_bytes(b"1")
    assert registry.latest("fresh") is None


@pytest.mark.cluster  # a SeaweedFS server
def test_server_killed_mid_upload_keeps_the_previous_latest(
    crashable: SeaweedServer,
    store_on: StoreOn,
    tmp_path: Path,
    tree_factory: Callable[..., RolloutTree],
) -> None:
    store = store_on(crashable, "runs", RetryPolicy(attempts=2, first_delay=0.2, max_delay=0.2))
    registry = CheckpointRegistry(store)
    v1 = checkpoint_dir(tmp_path / "v1", 1)
    registry.save("nightly", 1, v1)
    old_trees = [tree_factory(i) for i in range(3)]
    write_tree_set(store, "iter-1/trees", old_trees)
    v2 = checkpoint_dir(tmp_path / "v2", 2, big=BIG)

    def kill_midway(sent: int) -> None:
        if sent > 10 << 20 and crashable.running():
            crashable.kill()  # SIGKILL: no chance to finish anything

    with pytest.raises(StoreUnavailable, match=r"s3://trace/runs/checkpoints/nightly/iter-000002"):
        registry.save("nightly", 2, v2, progress=kill_midway)
    with pytest.raises(StoreUnavailable):  # a tree set written while the server is down
        write_tree_set(store, "iter-1/trees", [tree_factory(9)])
    assert not crashable.running()

    crashable.restart()
    latest = registry.latest("nightly")
    assert latest is not None and latest.iteration == 1
    registry.download(latest, tmp_path / "resume")
    assert same_files(tmp_path / "resume", v1)
    # The interrupted checkpoint has no manifest: it is not listed and latest never saw it.
    manifests = [
        o.key for o in store.list_objects("checkpoints") if o.key.endswith("manifest.json")
    ]
    assert manifests == [f"{latest.key}/manifest.json"]
    assert [c.iteration for c in registry.checkpoints("nightly")] == [1]
    trees = read_tree_set(store, "iter-1/trees")
    assert len(trees) == 3 and all(a.equals(b) for a, b in zip(trees, old_trees, strict=True))

    # Once the server is back, the same save goes through and moves latest.
    registry.save("nightly", 2, v2)
    registry.load_latest("nightly", tmp_path / "resume2")
    assert same_files(tmp_path / "resume2", v2)


@pytest.mark.cluster  # a SeaweedFS server
def test_an_upload_in_flight_retries_until_the_server_is_back(
    crashable: SeaweedServer, store_on: StoreOn, tmp_path: Path
) -> None:
    # Backoff 0.5, 1, 2, 3, 3, ... s: ≈30 s of retries. A restart takes ≈2 s, but SeaweedFS's
    # volume server sometimes needs 5-20 s more to register with its master again.
    store = store_on(crashable, "runs", RetryPolicy(attempts=12, first_delay=0.5, max_delay=3.0))
    registry = CheckpointRegistry(store)
    registry.save("nightly", 1, checkpoint_dir(tmp_path / "v1", 1))
    v2 = checkpoint_dir(tmp_path / "v2", 2, big=BIG)
    restarts: list[threading.Thread] = []

    def crash_and_recover(sent: int) -> None:
        if sent > 10 << 20 and not restarts:
            crashable.kill()
            restarts.append(threading.Thread(target=lambda: (time.sleep(0.5), crashable.restart())))
            restarts[0].start()

    started = time.monotonic()
    checkpoint = registry.save("nightly", 2, v2, progress=crash_and_recover)
    restarts[0].join()
    assert crashable.running() and time.monotonic() - started > 0.5
    latest = registry.latest("nightly")
    assert latest is not None and (latest.iteration, latest.key) == (2, checkpoint.key)
    registry.download(latest, tmp_path / "resume")  # sizes and sha256 checked
    assert same_files(tmp_path / "resume", v2)


# --- pruning: a run keeps its newest keep_checkpoints ------------------------------------------
def folders(store: LocalStore | S3Store, run: str) -> list[str]:
    """The run's checkpoint folders as the store lists them (complete or not)."""
    base = f"checkpoints/{run}/"
    return sorted(
        {o.key[len(base) :].split("/")[0] for o in store.list_objects(base[:-1])} - {"latest.json"}
    )


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.cluster  # a SeaweedFS server
def test_prune_keeps_the_newest_and_the_latest(
    where: str, tmp_path: Path, bucket_store: S3Store
) -> None:
    store = LocalStore(tmp_path / "store") if where == "local" else bucket_store
    registry = CheckpointRegistry(store)
    saved = [
        registry.save("nightly", i, checkpoint_dir(tmp_path / f"v{i}", i, big=1000))
        for i in range(1, 6)
    ]
    other = registry.save("other", 1, checkpoint_dir(tmp_path / "o1", 1))
    name = {c.iteration: c.key.rsplit("/", 1)[-1] for c in saved}
    assert registry.prune("nightly", 2) == [c.key for c in saved[:3]]  # oldest first
    # Every object of the deleted checkpoints is gone; the newest two are whole.
    assert folders(store, "nightly") == [name[4], name[5]]
    assert [c.iteration for c in registry.checkpoints("nightly")] == [4, 5]
    latest = registry.latest("nightly")
    assert latest is not None and latest.key == saved[-1].key
    registry.load_latest("nightly", tmp_path / "resume")
    assert same_files(tmp_path / "resume", tmp_path / "v5")
    assert registry.prune("nightly", 2) == []  # nothing more to delete
    assert registry.checkpoints("other") == [other]  # another run's are its own

    # latest.json names an older one (a person rolled the run back): it stays, whatever keep.
    pointer = {"iteration": 4, "folder": name[4]}
    store.put_bytes("checkpoints/nightly/latest.json", json.dumps(pointer).encode())
    assert registry.prune("nightly", 1) == []
    assert folders(store, "nightly") == [name[4], name[5]]
    # One a session still reads (its start, the KL anchor) stays too, given as a file's URI.
    store.put_bytes("checkpoints/nightly/latest.json", json.dumps({"folder": name[5]}).encode())
    policy = f"{store.uri(saved[3].key)}/policy"
    assert registry.prune("nightly", 1, protect=[None, policy]) == []
    assert registry.prune("nightly", 1) == [saved[3].key]
    assert folders(store, "nightly") == [name[5]]
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1, got 0"):
        registry.prune("nightly", 0)


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.cluster  # a SeaweedFS server
def test_a_commit_that_fails_prunes_nothing_and_one_that_succeeds_prunes(
    where: str,
    tmp_path: Path,
    bucket_store: S3Store,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pipeline's commit (``steps.commit.commit_checkpoint``, keep_checkpoints 1): the
    trainers uploaded the newer checkpoint's files but one, and the step died before the
    commit; nothing is deleted, ``latest`` stays. The next attempt's commit deletes the older
    checkpoints and the folders without a manifest of earlier iterations (saves that crashed
    before their commit); one of a later iteration (a save in flight) stays."""
    from trace_core.store.artifacts import file_sha256
    from trace_core.train.config import TrainConfig
    from trace_core.train.contract import PipelineConfig
    from trace_core.train.record import IterationRecord
    from trace_core.train.steps.commit import commit_checkpoint

    store = LocalStore(tmp_path / "store") if where == "local" else bucket_store
    registry = CheckpointRegistry(store)
    config = PipelineConfig(TrainConfig(), "nightly", store.root_uri, keep_checkpoints=1)
    first = registry.save("nightly", 1, checkpoint_dir(tmp_path / "v1", 1))
    second = registry.save("nightly", 2, checkpoint_dir(tmp_path / "v2", 2))
    in_flight = registry.reserve("nightly", 4)  # another save, still uploading
    store.put_bytes(f"{in_flight}/model.safetensors", b"half")
    crashed = registry.reserve("nightly", 2)  # a save of 2 that died before its commit
    store.put_bytes(f"{crashed}/model.safetensors", b"half")
    predictor = tmp_path / "predictor"
    predictor.mkdir()
    (predictor / "predictor.json").write_text("{}")
    records = [IterationRecord(i, "trace", 0, 0, {}, {}, None, {}) for i in range(4)]

    third = registry.reserve("nightly", 3)
    weights = checkpoint_dir(tmp_path / "v3", 3, big=2000)
    written = {}
    for path in sorted(p for p in weights.rglob("*") if p.is_file()):
        relative = path.relative_to(weights).as_posix()
        written[relative] = (path.stat().st_size, file_sha256(path))
        if relative != "model.safetensors":  # the step died before this one was stored
            store.put_file(f"{third}/{relative}", path)
    with pytest.raises(StoreError, match=r"model\.safetensors is missing"):
        commit_checkpoint(config, registry, third, written, records, predictor)
    latest = registry.latest("nightly")
    assert latest is not None and latest.key == second.key
    assert registry.checkpoints("nightly") == [first, second]  # none deleted
    assert crashed.rsplit("/", 1)[-1] in folders(store, "nightly")

    store.put_file(f"{third}/model.safetensors", weights / "model.safetensors")
    committed = commit_checkpoint(config, registry, third, written, records, predictor)
    assert committed == sum(c.bytes for c in registry.checkpoints("nightly")[0].files)
    assert [c.key for c in registry.checkpoints("nightly")] == [third]
    latest = registry.latest("nightly")
    assert latest is not None and latest.key == third
    names = [k.rsplit("/", 1)[-1] for k in (third, in_flight)]
    assert folders(store, "nightly") == sorted(names)  # the save in flight is untouched
    said = capsys.readouterr().out.splitlines()
    assert said == [
        f"deleted checkpoint {store.uri(key)} (keep_checkpoints 1)"
        for key in (first.key, second.key, crashed)  # by iteration, the complete ones first
    ]
