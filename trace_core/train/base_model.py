"""Where a run's starting policy comes from: an HF folder, or an ``s3://`` prefix fetched once.

    folder = fetch_model("s3://models/smollm2", Path("build/train/run/init"))
    tokenizer = source_tokenizer("s3://models/smollm2")   # its tokenizer files only

A remote model is downloaded into a staging folder beside ``folder``, checked
(``policy.checkpoint``) and renamed into place, with the URI it came from in ``SOURCE``; a run
that starts again finds it there and does not download it twice. A folder that holds anything
else is refused, not overwritten. A local source is checked and used where it lies (``file://``
is a local path). Importable without torch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trace_core.policy.checkpoint import check_checkpoint, load_tokenizer
from trace_core.rollout.weights import SOURCE, download_checkpoint
from trace_core.store.uri import is_remote

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def not_weights(key: str) -> bool:
    """Whether a checkpoint's file is not a weights file (config, tokenizer, log)."""
    return not key.endswith(WEIGHT_SUFFIXES)


def local_path(source: str | Path) -> Path | None:
    """``source`` as a local path, or None for a remote URI."""
    text = str(source)
    return None if is_remote(text) else Path(text.removeprefix("file://"))


def fetch_model(source: str | Path, folder: Path, what: str = "--init") -> Path:
    """The checked local folder of the model at ``source``: the path itself when local, else
    ``folder`` (downloaded unless it already holds this source)."""
    local = local_path(source)
    if local is not None:
        return check_checkpoint(local, what)
    uri = str(source)
    if folder.exists():
        stored = (folder / SOURCE).read_text().strip() if (folder / SOURCE).is_file() else None
        if stored != uri:
            held = f"a download of {stored}" if stored else "files of its own"
            raise ValueError(f"{folder} holds {held}, not {uri}; remove it or use another folder")
        return check_checkpoint(folder, f"{what} {uri} (downloaded to {folder})")
    return download_checkpoint(uri, folder, what)


def source_tokenizer(source: str | Path, what: str = "--init") -> PreTrainedTokenizerBase:
    """The tokenizer of the model at ``source``; of a remote one, only its non-weight files
    are downloaded (into a folder removed afterwards)."""
    local = local_path(source)
    if local is not None:
        return load_tokenizer(local, what)
    from trace_core.store.sync import download_folder

    with tempfile.TemporaryDirectory(prefix="tokenizer-") as folder:
        download_folder(str(source), folder, keep=not_weights)
        return load_tokenizer(folder, f"{what} {source}")
