"""A starting policy from a local folder or an s3:// prefix (the session's SeaweedFS server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_core.envs.calc import CalcSuite
from trace_core.policy.checkpoint import CheckpointError
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.store.artifacts import open_store
from trace_core.store.sync import upload_folder
from trace_core.train.base_model import SOURCE, fetch_model, source_tokenizer

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("source") / "policy"
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, SMALL, seed=0), tokenizer, path)
    return path


def files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_a_local_source_is_used_where_it_lies(policy: Path, tmp_path: Path) -> None:
    assert fetch_model(policy, tmp_path / "init") == policy
    assert fetch_model(f"file://{policy}", tmp_path / "init") == policy
    assert not (tmp_path / "init").exists()
    with pytest.raises(CheckpointError, match=r"--init .*does not exist"):
        fetch_model(tmp_path / "missing", tmp_path / "init")


def test_a_remote_source_is_downloaded_once(
    policy: Path, tmp_path: Path, s3_env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    uri = f"s3://trace/{request.node.name}/policy"
    upload_folder(policy, uri)
    folder = fetch_model(uri, tmp_path / "init")
    assert folder == tmp_path / "init"
    assert (folder / SOURCE).read_text() == uri + "\n"
    got = files(folder)
    assert got.pop(SOURCE) and got == files(policy)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left

    # Found again without the store: the bucket's copy is gone, the download is not repeated.
    store = open_store(uri)
    for obj in store.list_objects(""):
        store.delete(obj.key)
    assert fetch_model(uri, tmp_path / "init", "--init") == folder
    with pytest.raises(ValueError, match=f"holds a download of {uri}, not s3://trace/other"):
        fetch_model("s3://trace/other", folder)


def test_a_folder_of_other_files_is_refused_not_overwritten(
    policy: Path, tmp_path: Path, s3_env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    uri = f"s3://trace/{request.node.name}/policy"
    upload_folder(policy, uri)
    mine = tmp_path / "init"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files of its own"):
        fetch_model(uri, mine)
    assert files(mine) == {"notes.txt": b"mine"}


def test_a_damaged_remote_model_leaves_nothing_behind(
    policy: Path, tmp_path: Path, s3_env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    uri = f"s3://trace/{request.node.name}/policy"
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name, data in files(policy).items():
        (damaged / name).write_bytes(data[:100] if name == "model.safetensors" else data)
    upload_folder(damaged, uri)
    (tmp_path / "work").mkdir()
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*truncated"):
        fetch_model(uri, tmp_path / "work" / "init")
    assert list((tmp_path / "work").iterdir()) == []
    # The tokenizer alone never reads the weights: it loads from the same damaged prefix.
    tokenizer = source_tokenizer(uri)
    assert tokenizer.get_vocab() == source_tokenizer(policy).get_vocab()
    with pytest.raises(FileNotFoundError, match="s3://trace/nothing-here: nothing to download"):
        source_tokenizer("s3://trace/nothing-here")
