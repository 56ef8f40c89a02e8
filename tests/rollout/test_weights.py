"""Engine weights from object storage: each node downloads a remote checkpoint once into its
cache (``rollout.weights``), against the session's real SeaweedFS server."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout import weights
from trace_core.rollout.weights import CACHE_ENV, KEEP, node_checkpoint
from trace_core.store.artifacts import open_store
from trace_core.store.sync import upload_folder

pytestmark = pytest.mark.cluster  # the session's S3 server

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, SMALL, seed=0), tokenizer, tmp_path / "policy")
    return tmp_path / "policy"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.usefixtures("s3_env")
def test_a_remote_checkpoint_is_downloaded_once_per_node(
    policy: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"s3://trace/weights/{uuid.uuid4().hex[:8]}/policy"
    upload_folder(policy, uri)
    folder = node_checkpoint(uri)
    assert folder.parent == cache
    assert (folder / "model.safetensors").read_bytes() == (
        policy / "model.safetensors"
    ).read_bytes()
    assert (folder / "source.txt").read_text().strip() == uri

    downloads: list[str] = []

    def download(uri: str, folder: Path, what: str) -> Path:
        downloads.append(uri)
        folder.mkdir()
        return folder

    monkeypatch.setattr(weights, "download_checkpoint", download)
    assert node_checkpoint(uri) == folder and downloads == []  # found in the cache
    (folder / "source.txt").unlink()  # a copy cut short: fetched again
    node_checkpoint(uri)
    assert downloads == [uri]


@pytest.mark.usefixtures("s3_env")
def test_the_cache_keeps_the_most_recent_checkpoints(policy: Path, cache: Path) -> None:
    prefix = f"s3://trace/weights/{uuid.uuid4().hex[:8]}"
    uris = [f"{prefix}/iteration-{i}" for i in range(KEEP + 2)]
    for uri in uris:
        upload_folder(policy, uri)
    folders = [node_checkpoint(uri) for uri in uris]
    kept = sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert kept == sorted(folders[-KEEP:])


@pytest.mark.usefixtures("s3_env")
def test_a_remote_folder_that_is_no_checkpoint_is_refused_and_not_cached(
    cache: Path, tmp_path: Path
) -> None:
    uri = f"s3://trace/weights/{uuid.uuid4().hex[:8]}/not-a-policy"
    open_store(uri).put_bytes("notes.txt", b"hello")
    with pytest.raises(Exception, match="not-a-policy"):
        node_checkpoint(uri)
    assert [p for p in cache.iterdir() if p.is_dir()] == []


def test_a_local_checkpoint_is_used_where_it_lies(policy: Path) -> None:
    assert node_checkpoint(policy) == policy
    assert node_checkpoint(f"file://{policy}") == policy
