"""The artifact store on a local folder and on a real S3 server (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import urllib.request
from pathlib import Path

import pytest

from trace_core.envs.source import read_records
from trace_core.store.artifacts import (
    AccessDenied,
    LocalStore,
    ObjectNotFound,
    RetryPolicy,
    S3Settings,
    S3Store,
    StoreError,
    StoreUnavailable,
    open_store,
)
from trace_core.store.server import SeaweedServer

SECRET = "s3cr3t-Value-that-must-never-leak"
KEY_ID = "AKIA-test-key-id-never-printed"


# --- local ---------------------------------------------------------------------------------------
def test_local_round_trip_and_listing(tmp_path: Path) -> None:
    store = open_store(tmp_path / "art")
    assert isinstance(store, LocalStore)
    store.put_bytes("a/b.json", b"{}")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 3_000_000)
    seen: list[int] = []
    store.put_file("a/c/big.bin", src, progress=seen.append)
    assert seen[-1] == 3_000_000
    assert store.get_bytes("a/b.json") == b"{}"
    store.get_file("a/c/big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert [(o.key, o.size) for o in store.list_objects("a")] == [
        ("a/b.json", 2),
        ("a/c/big.bin", 3_000_000),
    ]
    assert store.exists("a/b.json") and not store.exists("a/nope")
    # No temp file is left beside the objects, and hidden files are not listed.
    assert sorted(p.name for p in (tmp_path / "art" / "a").iterdir()) == ["b.json", "c"]
    (tmp_path / "art" / "a" / ".x.tmp").write_bytes(b"")
    assert len(store.list_objects()) == 2
    store.delete("a/b.json")
    assert not store.exists("a/b.json")


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.cluster  # a SeaweedFS server
def test_delete_prefix_deletes_one_folder_and_only_it(
    where: str, tmp_path: Path, bucket_store: S3Store
) -> None:
    """A folder's every object, nested ones too (S3: more than one multi-object delete),
    and nothing beside it: not the sibling whose name it begins, nor the root."""
    store = LocalStore(tmp_path / "store") if where == "local" else bucket_store
    keys = [f"sessions/run-1/state-{i:04d}/predictor/p.bin" for i in range(1_100)]
    keys = keys if where == "s3" else keys[:5]  # S3's multi-object delete takes 1,000 a call
    for key in [*keys, "sessions/run-1/trees-0001/trees.parquet"]:
        store.put_bytes(key, b"x")
    store.put_bytes("sessions/run-10/state-0001/state.json", b"{}")  # a prefix of its name
    store.put_bytes("sessions/run-1.json", b"{}")
    assert store.delete_prefix("sessions/run-1") == len(keys) + 1
    assert [o.key for o in store.list_objects("")] == [
        "sessions/run-1.json",
        "sessions/run-10/state-0001/state.json",
    ]
    assert store.delete_prefix("sessions/run-1") == 0  # nothing left: no error
    assert store.delete_prefix("nowhere/at/all") == 0
    with pytest.raises(ValueError, match="delete_prefix needs a prefix below the store's root"):
        store.delete_prefix("")
    assert len(store.list_objects("")) == 2


def test_local_errors_name_the_path(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    with pytest.raises(ObjectNotFound, match=f"{tmp_path}/missing.json: no such file"):
        store.get_bytes("missing.json")
    with pytest.raises(FileNotFoundError):  # ObjectNotFound is one
        store.get_file("missing.json", tmp_path / "x")
    with pytest.raises(ValueError, match=r"without '\.\.'"):
        store.put_bytes("../escape", b"")
    with pytest.raises(ValueError, match="unsupported URI scheme 'gs'"):
        open_store("gs://bucket/x")
    with pytest.raises(ValueError, match="s3://B_ad/x: invalid bucket name"):
        open_store("s3://B_ad/x")


def test_a_failed_local_write_leaves_the_old_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("m.json", b"old")
    with pytest.raises(FileNotFoundError):
        store.put_file("m.json", tmp_path / "does-not-exist")
    assert store.get_bytes("m.json") == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


# --- settings ----------------------------------------------------------------------------------
def test_settings_come_from_the_environment_and_are_never_printed() -> None:
    env = {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": "http://seaweedfs.kubeflow:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    s = S3Settings.from_env(env)
    assert (s.endpoint, s.secure, s.region) == ("seaweedfs.kubeflow:9000", False, "eu-west-1")
    assert SECRET not in repr(s) and KEY_ID not in repr(s)
    assert s.redact(f"key {KEY_ID} secret {SECRET}") == "key *** secret ***"
    # AWS_ENDPOINT_URL_S3 wins; a bare host:port means https; no endpoint means AWS.
    s = S3Settings.from_env({**env, "AWS_ENDPOINT_URL_S3": "minio:9000"})
    assert (s.endpoint, s.secure) == ("minio:9000", True)
    s = S3Settings.from_env({"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET})
    assert (s.endpoint, s.region) == (None, "us-east-1")
    with pytest.raises(AccessDenied, match="set AWS_SECRET_ACCESS_KEY in the environment"):
        S3Settings.from_env({"AWS_ACCESS_KEY_ID": KEY_ID})
    with pytest.raises(ValueError, match=r"ftp://host: expected http\(s\)://host\[:port\]"):
        S3Settings.from_env({**env, "S3_ENDPOINT": "ftp://host", "AWS_ENDPOINT_URL": ""})


def test_credentials_in_a_uri_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="must not hold credentials") as err:
        open_store(f"s3://{KEY_ID}:{SECRET}@bucket/prefix")
    assert SECRET not in str(err.value) and KEY_ID not in str(err.value)


# --- S3 ----------------------------------------------------------------------------------------
@pytest.mark.cluster  # a SeaweedFS server
def test_s3_round_trip(bucket_store: S3Store, tmp_path: Path) -> None:
    store = bucket_store
    store.put_bytes("runs/a.json", b'{"a": 1}')
    store.put_bytes("runs/b/c.txt", b"c")
    assert store.get_bytes("runs/a.json") == b'{"a": 1}'
    assert [o.key for o in store.list_objects("runs")] == ["runs/a.json", "runs/b/c.txt"]
    assert store.exists("runs/a.json") and not store.exists("runs/zzz")
    store.put_bytes("runs/a.json", b"v2")  # replaced whole
    assert store.get_bytes("runs/a.json") == b"v2"
    store.delete("runs/a.json")
    assert [o.key for o in store.list_objects("")] == ["runs/b/c.txt"]


@pytest.mark.cluster  # a SeaweedFS server
def test_s3_multipart_upload_of_a_large_file(bucket_store: S3Store, tmp_path: Path) -> None:
    # 13 MiB: above minio's 5 MiB part size, so three parts in a multipart upload.
    data = os.urandom(13 << 20)
    src = tmp_path / "model.safetensors"
    src.write_bytes(data)
    seen: list[int] = []
    bucket_store.put_file("ckpt/model.safetensors", src, progress=seen.append)
    assert seen[-1] == len(data)
    back = tmp_path / "back"
    bucket_store.get_file("ckpt/model.safetensors", back)
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert bucket_store.list_objects("ckpt")[0].size == len(data)
    # A ranged read through pyarrow's S3FileSystem sees the same bytes.
    fs, path = bucket_store.arrow_path("ckpt/model.safetensors")
    with fs.open_input_file(path) as f:
        f.seek(7 << 20)
        assert f.read(1000) == data[7 << 20 : (7 << 20) + 1000]


@pytest.mark.cluster  # a SeaweedFS server
def test_missing_object_and_bucket_name_the_uri(seaweed: SeaweedServer, prefix: str) -> None:
    settings = S3Settings.from_env(seaweed.env())
    store = S3Store("trace", prefix, settings)
    with pytest.raises(ObjectNotFound, match=f"s3://trace/{prefix}/nope.json: no such object"):
        store.get_bytes("nope.json")
    nobucket = S3Store("no-such-bucket", "x", settings)
    with pytest.raises(ObjectNotFound, match=r"s3://no-such-bucket/x/k: bucket 'no-such-bucket'"):
        nobucket.get_bytes("k")
    with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket' does not exist"):
        nobucket.list_objects()


@pytest.mark.cluster  # a SeaweedFS server
def test_writing_to_a_missing_bucket_creates_nothing(
    seaweed: SeaweedServer, tmp_path: Path
) -> None:
    settings = S3Settings.from_env(seaweed.env())
    store = S3Store("no-such-bucket", "run", settings)
    src = tmp_path / "f"
    src.write_bytes(b"1")
    for write in (lambda: store.put_bytes("a.json", b"{}"), lambda: store.put_file("b", src)):
        with pytest.raises(
            ObjectNotFound,
            match=r"s3://no-such-bucket/run/.*bucket 'no-such-bucket' does not exist",
        ):
            write()
    # The server would have made the bucket on the first PUT; the store asked first.
    assert "no-such-bucket" not in [b.name for b in store.client.list_buckets()]


@pytest.mark.cluster  # a SeaweedFS server
def test_wrong_credentials_are_refused_without_leaking_them(
    seaweed: SeaweedServer, prefix: str, tmp_path: Path
) -> None:
    right = S3Store("trace", prefix, S3Settings.from_env(seaweed.env()))
    right.put_bytes("x.json", b"{}")
    for env in (
        {**seaweed.env(), "AWS_SECRET_ACCESS_KEY": SECRET},  # right key id, wrong secret
        {**seaweed.env(), "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET},
    ):
        wrong = S3Store("trace", prefix, S3Settings.from_env(env), RetryPolicy(attempts=1))
        src = tmp_path / "f"
        src.write_bytes(b"1")
        for call in (
            lambda w=wrong: w.get_bytes("x.json"),
            lambda w=wrong: w.put_bytes("y.json", b"1"),
            lambda w=wrong, src=src: w.put_file("y.json", src),
            lambda w=wrong: w.list_objects(),
        ):
            with pytest.raises(AccessDenied, match=f"s3://trace/{prefix}") as err:
                call()
            text = f"{err.value} {err.value!r}"
            assert SECRET not in text and KEY_ID not in text
            assert "AWS_ACCESS_KEY_ID" in text  # says what to check
            assert err.value.__cause__ is None and err.value.__suppress_context__
    assert [o.key for o in right.list_objects()] == ["x.json"]


def test_an_unreachable_server_is_retried_then_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    store = S3Store("bkt", "p", S3Settings.from_env(env), RetryPolicy(3, 0.05, 0.1))
    with pytest.raises(StoreUnavailable, match=r"s3://bkt/p/k: download failed after 3 attempts"):
        store.get_bytes("k")
    with pytest.raises(StoreError) as err:
        store.put_bytes("k", b"1")
    assert SECRET not in str(err.value) and KEY_ID not in str(err.value)
    # Each retry is logged (2 per call here), naming the URI and never a credential.
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 4 and all(m.startswith("s3://bkt/p/k: ") for m in retries)
    assert SECRET not in caplog.text and KEY_ID not in caplog.text


@pytest.mark.cluster  # a SeaweedFS server
def test_dataset_loaders_read_s3_through_the_store(
    s3_env: dict[str, str], bucket_store: S3Store
) -> None:
    bucket_store.put_bytes("data/train.jsonl", b'{"problem": "1+1?", "answer": "2"}\n')
    uri = f"s3://trace/{bucket_store.prefix}/data/train.jsonl"
    assert read_records(uri) == [{"problem": "1+1?", "answer": "2"}]
    assert read_records(uri.replace("s3://", "minio://")) == read_records(uri)
    with pytest.raises(FileNotFoundError, match=r"train\.json: no such object"):
        read_records(uri[: -len("l")])


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            if width == 8:
                ip = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                ip = address
            found.add((ip, int(port, 16)))
    return found


@pytest.mark.cluster  # a SeaweedFS server
def test_the_server_listens_on_loopback_only_and_stops_by_pid(tmp_path: Path) -> None:
    server = SeaweedServer.start(tmp_path / "s3")
    try:
        pid = server.pid
        assert pid is not None
        sockets = _listening(pid)
        assert ("127.0.0.1", server.ports["s3.port"]) in sockets
        assert {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
        assert {port for _, port in sockets} <= set(server.ports.values())
        # 64 MiB volume slots, whatever the disk's size: the master counts about one a 64 MiB of
        # free space (1 GiB slots, mini's own choice on a large disk, would give 16 times fewer).
        master = f"http://127.0.0.1:{server.ports['master.port']}/dir/status"
        with urllib.request.urlopen(master, timeout=10) as answer:
            slots = json.load(answer)["Topology"]["Max"]
        assert slots >= shutil.disk_usage(tmp_path).free // (128 << 20), slots
        assert server.errors() == []
    finally:
        server.stop()
    assert not server.running()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert not list(Path("/tmp").glob(f"seaweedfs-*-{server.ports['s3.port']}.sock"))


def test_the_servers_error_lines_are_read_from_its_log(tmp_path: Path) -> None:
    server = SeaweedServer(tmp_path, "key", "secret", {}, ())
    assert server.errors() == []  # no log yet
    lines = [
        "I1206 19:24:08.1 master.go:1] started",
        "E1206 19:24:08.3 upload_chunked.go:281 chunked upload failed: no free volumes left",
        "W1206 19:24:08.5 worker.go:180 stream ended",
        "Error: not a glog line",
        "E1206 19:24:09.8 s3api_object_handlers_put.go:626 putToFiler: chunked upload failed",
    ]
    server.log_path.write_text("\n".join(lines) + "\n")
    assert server.errors() == [lines[1], lines[4]]
    assert server.errors(last=1) == [lines[4]]


# --- a run store of its own ---------------------------------------------------------------------
def test_a_run_store_holds_its_bucket_and_kfps_store_the_rest(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TRACE_STORE_* set (a pipeline compiled with --run-store-endpoint), s3:// URIs in the
    run store's bucket go to that server with its own keys; KFP's artifacts (minio://) and any
    other bucket stay on the AWS_* store."""
    from trace_core.store.s3_settings import check_run_store

    with SeaweedServer.start(
        tmp_path / "runs", access_key="run-store-key", secret_key=SECRET, buckets=("runs",)
    ) as runs:
        run_store = {
            "TRACE_STORE_BUCKET": "runs",
            "TRACE_STORE_ENDPOINT_URL": runs.endpoint,
            "TRACE_STORE_ACCESS_KEY_ID": runs.access_key,
            "TRACE_STORE_SECRET_ACCESS_KEY": runs.secret_key,
        }
        for name, value in run_store.items():
            monkeypatch.setenv(name, value)
        open_store("s3://runs/ckpt/run-1").put_bytes("iter-000001/manifest.json", b"{}")
        open_store("minio://trace/kfp/step-1").put_bytes("trees.parquet", b"PAR1")
        open_store("s3://trace/other").put_bytes("x.json", b"[]")

        direct = S3Store("runs", "", S3Settings.from_env({**runs.env()}))
        assert [o.key for o in direct.list_objects("ckpt")] == [
            "ckpt/run-1/iter-000001/manifest.json"
        ]
        kfp = S3Store("trace", "", S3Settings.from_env(s3_env))
        assert kfp.get_bytes("kfp/step-1/trees.parquet") == b"PAR1"
        assert kfp.get_bytes("other/x.json") == b"[]"
        assert not kfp.exists("ckpt/run-1/iter-000001/manifest.json")

        # A run given another bucket would put its checkpoints on KFP's store: prep refuses it.
        check_run_store("s3://runs/ckpt")
        with pytest.raises(ValueError, match=r"store_uri s3://trace/ckpt: the run store serves"):
            check_run_store("s3://trace/ckpt")
        # Its endpoint and keys are required, by name; the secret is never printed.
        monkeypatch.delenv("TRACE_STORE_ENDPOINT_URL")
        with pytest.raises(ValueError, match="TRACE_STORE_BUCKET=runs needs TRACE_STORE_ENDPOINT"):
            open_store("s3://runs/ckpt")
        monkeypatch.setenv("TRACE_STORE_ENDPOINT_URL", runs.endpoint)
        monkeypatch.delenv("TRACE_STORE_SECRET_ACCESS_KEY")
        with pytest.raises(AccessDenied, match="set TRACE_STORE_SECRET_ACCESS_KEY") as err:
            open_store("s3://runs/ckpt")
        assert SECRET not in str(err.value)
