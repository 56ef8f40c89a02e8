"""Tree sets (Parquet parts + a manifest written last) and what ``open_trees`` resolves."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from trace_core.algo.tree import RolloutTree
from trace_core.bench.store import sim_trees
from trace_core.store.artifacts import ArtifactStore, LocalStore, ObjectNotFound, S3Store
from trace_core.store.schema import SchemaError, to_table, write_trees
from trace_core.store.treeset import (
    MANIFEST,
    ManifestError,
    open_trees,
    read_manifest,
    read_tree_set,
    write_tree_set,
)


def assert_same(got: list[RolloutTree], want: list[RolloutTree]) -> None:
    assert len(got) == len(want)
    assert all(a.equals(b) for a, b in zip(got, want, strict=True))


class FailingManifestStore:
    """A real store whose manifest PUT fails, as if the step died right before it (a fake)."""

    def __init__(self, inner: ArtifactStore) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def put_bytes(self, key: str, data: bytes) -> None:
        if key.endswith(MANIFEST):
            raise ConnectionError("the step died before its manifest")
        self.inner.put_bytes(key, data)


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.cluster  # a SeaweedFS server
def test_round_trip_in_parts(
    where: str, tmp_path: Path, bucket_store: S3Store, tree_factory: Callable[..., RolloutTree]
) -> None:
    store: ArtifactStore = LocalStore(tmp_path) if where == "local" else bucket_store
    trees = [tree_factory(i) for i in range(5)] + sim_trees(6)
    manifest = write_tree_set(
        store, "run/iter-1/trees", trees, metadata={"step": "rollout"}, rows_per_file=20
    )
    # 8-node hand trees, 20 rows a part: parts of 2, 2, then the 5th hand tree with the sims.
    assert manifest.trees == 11 and len(manifest.files) >= 3
    assert manifest.nodes == sum(t.size for t in trees) == sum(f.rows for f in manifest.files)
    assert read_manifest(store, "run/iter-1/trees").metadata == {"step": "rollout"}
    assert_same(read_tree_set(store, "run/iter-1/trees"), trees)
    # Every listed part exists with the size the manifest gives.
    sizes = {o.key: o.size for o in store.list_objects("run")}
    for part in manifest.files:
        assert sizes[f"run/iter-1/trees/{part.name}"] == part.bytes


def test_a_set_is_invisible_until_its_manifest_is_written(
    tmp_path: Path, tree_factory: Callable[..., RolloutTree]
) -> None:
    store = LocalStore(tmp_path)
    old = [tree_factory(i) for i in range(3)]
    write_tree_set(store, "trees", old)
    new = [tree_factory(i, iteration=1) for i in range(5)]
    with pytest.raises(ConnectionError):
        write_tree_set(FailingManifestStore(store), "trees", new)  # type: ignore[arg-type]
    # The new parts were uploaded, but no manifest lists them: readers still see the old set.
    assert len([o for o in store.list_objects("trees") if o.key.endswith(".parquet")]) == 2
    assert_same(read_tree_set(store, "trees"), old)
    assert open_trees(str(tmp_path / "trees")).read(["tree_id"]).num_rows == 3 * old[0].size
    # A complete rewrite replaces the set as a whole.
    write_tree_set(store, "trees", new)
    assert_same(read_tree_set(store, "trees"), new)


def test_open_trees_resolves_files_sets_and_folders(
    tmp_path: Path, tree_factory: Callable[..., RolloutTree]
) -> None:
    trees = [tree_factory(i) for i in range(4)]
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    write_trees(tmp_path / "plain" / "a.parquet", trees[:2])
    write_trees(tmp_path / "plain" / "sub" / "b.parquet", trees[2:])
    (tmp_path / "plain" / "notes.txt").write_text("not trees")
    store = LocalStore(tmp_path / "run")
    write_tree_set(store, "iter-0/trees", trees[:1])
    write_tree_set(store, "iter-1/trees", trees[1:])
    (tmp_path / "run" / "iter-1" / "trees" / "part-orphan.parquet").write_bytes(b"half")

    one = open_trees(str(tmp_path / "plain" / "a.parquet"))
    assert one.keys == ("",) and one.read(["node_id"]).num_rows == 16
    plain = open_trees(str(tmp_path / "plain"))
    assert plain.keys == ("a.parquet", "sub/b.parquet")
    sets = open_trees(f"file://{tmp_path}/run")
    assert len(sets.keys) == 2 and all("orphan" not in k for k in sets.keys)
    assert sets.read(["node_id"]).num_rows == 32


def test_open_trees_errors_name_what_is_wrong(
    tmp_path: Path, tree_factory: Callable[..., RolloutTree]
) -> None:
    with pytest.raises(ObjectNotFound, match=f"{tmp_path}/nothing: no such file, folder"):
        open_trees(str(tmp_path / "nothing"))
    (tmp_path / "empty-ish").mkdir()
    (tmp_path / "empty-ish" / "x.txt").write_text("")
    with pytest.raises(ObjectNotFound, match="no rollout trees here"):
        open_trees(str(tmp_path / "empty-ish"))

    store = LocalStore(tmp_path / "set")
    manifest = write_tree_set(store, "t", [tree_factory(0)])
    (tmp_path / "set" / "t" / manifest.files[0].name).unlink()
    with pytest.raises(ObjectNotFound, match=rf"{manifest.files[0].name}: listed in .*manifest"):
        open_trees(str(tmp_path / "set"))

    body = json.loads(manifest.to_json())
    body["files"][0]["rows"] = "many"
    store.put_bytes("t/manifest.json", json.dumps(body).encode())
    with pytest.raises(
        ManifestError, match=r"t/manifest\.json: field files\[0\]\.rows must be int"
    ):
        read_tree_set(store, "t")
    store.put_bytes("t/manifest.json", b"{")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_tree_set(store, "t")

    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(OSError, match=r"bad\.parquet"):
        open_trees(str(tmp_path / "bad.parquet")).read()
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(SchemaError, match=r"other\.parquet: schema metadata has no"):
        open_trees(str(tmp_path / "other.parquet")).read()


def test_every_file_of_a_folder_is_checked(
    tmp_path: Path, tree_factory: Callable[..., RolloutTree]
) -> None:
    # Without the check a foreign file's rows would come back as nulls (pyarrow takes the
    # first file's schema for all); only the footers are read to find it.
    good = to_table([tree_factory(0)])
    wrong_type = good.set_column(
        good.schema.get_field_index("reward"), "reward", pc.cast(good["reward"], pa.string())
    )
    bad = {
        "foreign.parquet": (pa.table({"x": [1, 2]}), r"schema metadata has no 'trace\.schema"),
        "no-reward.parquet": (good.drop_columns(["reward"]), r"column 'reward' is missing"),
        "string-reward.parquet": (
            wrong_type,
            r"column 'reward' has type string, expected double",
        ),
    }
    for name, (table, message) in bad.items():
        folder = tmp_path / name.removesuffix(".parquet")
        folder.mkdir()
        write_trees(folder / "a.parquet", [tree_factory(0)])
        pq.write_table(table, folder / name)
        with pytest.raises(SchemaError, match=rf"^{folder}/{name}: {message}.*; every file under "):
            open_trees(str(folder)).read(["node_id"])

    folder = tmp_path / "damaged"
    folder.mkdir()
    write_trees(folder / "a.parquet", [tree_factory(0)])
    whole = (folder / "a.parquet").read_bytes()
    for name, data in (("b-truncated.parquet", whole[: len(whole) // 2]), ("c.parquet", b"text")):
        (folder / name).write_bytes(data)
        with pytest.raises(OSError, match=rf"^{folder}/{name}: .*Parquet"):
            open_trees(str(folder)).dataset()
        (folder / name).unlink()
    assert open_trees(str(folder)).read(["node_id"]).num_rows == 8


@pytest.mark.cluster  # a SeaweedFS server
def test_open_trees_on_s3(
    s3_env: dict[str, str], bucket_store: S3Store, tree_factory: Callable[..., RolloutTree]
) -> None:
    trees = [tree_factory(i) for i in range(3)]
    write_tree_set(bucket_store, "iter-7/trees", trees)
    source = open_trees(f"s3://trace/{bucket_store.prefix}")
    assert source.uri == f"s3://trace/{bucket_store.prefix}"
    assert source.read(["tree_id"]).column("tree_id").to_pylist() == [0] * 8 + [1] * 8 + [2] * 8
    single = open_trees(
        f"s3://trace/{bucket_store.prefix}/iter-7/trees/{source.keys[0].split('/')[-1]}"
    )
    assert single.read(["node_id"]).num_rows == 24
    with pytest.raises(ObjectNotFound, match=f"s3://trace/{bucket_store.prefix}/nope: no such"):
        open_trees(f"s3://trace/{bucket_store.prefix}/nope")
