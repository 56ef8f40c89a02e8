"""Where a run's starting policy comes from: an HF folder, or an ``s3://`` prefix fetched once.

    folder = fetch_model("s3://models/smollm2", Path("build/train/run/init"))
    tokenizer = source_tokenizer("s3://models/smollm2")   # its tokenizer and config files only
    check_source("s3://models/smollm2")                   # config and safetensors, by listing
    upload_model(Path("build/models/smollm2"), "s3://models/smollm2")   # trace-rl model upload

A remote model is downloaded into a staging folder beside ``folder``, checked
(``policy.checkpoint``) and renamed into place, with the URI it came from in ``SOURCE``; a run
that starts again finds it there and does not download it twice. A folder that holds anything
else is refused, not overwritten. A local source is checked and used where it lies (``file://``
is a local path). ``upload_model`` puts an HF folder where ``base_model_uri`` reads it, below a
prefix that holds nothing yet. Importable without torch.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trace_core.policy.checkpoint import (
    WEIGHTS,
    WEIGHTS_INDEX,
    CheckpointError,
    check_checkpoint,
    load_tokenizer,
)
from trace_core.rollout.weights import SOURCE, download_checkpoint
from trace_core.store.uri import is_remote

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
"""Pickled weights: never loaded (``policy.model``), never uploaded."""
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".h5", ".msgpack", ".onnx", *PICKLE_SUFFIXES)
LIGHT_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
"""A model folder's config and tokenizer files (config.json, tokenizer.json, vocab.json,
merges.txt, tokenizer.model, chat_template.jinja, ...): what the start steps read of it."""


def not_weights(key: str) -> bool:
    """Whether a checkpoint's file is not a weights file (config, tokenizer, log)."""
    return not key.lower().endswith(WEIGHT_SUFFIXES)


def light_file(key: str) -> bool:
    """Whether a model folder's file is one of its config and tokenizer files, by name: at the
    top of the folder, with one of ``LIGHT_SUFFIXES``."""
    return "/" not in key and key.lower().endswith(LIGHT_SUFFIXES)


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
    """The tokenizer of the model at ``source``; of a remote one, only its config and
    tokenizer files (``light_file``) are downloaded, into a folder removed afterwards."""
    local = local_path(source)
    if local is not None:
        return load_tokenizer(local, what)
    from trace_core.store.sync import download_folder

    with tempfile.TemporaryDirectory(prefix="tokenizer-") as folder:
        download_folder(str(source), folder, keep=light_file)
        return load_tokenizer(folder, f"{what} {source}")


def check_source(source: str | Path, what: str = "--init") -> None:
    """That the model at ``source`` has a config and its weights as safetensors: a local one
    is checked as a checkpoint (weights' headers only); a remote one by its listing, and its
    shard index if it has one (no weights read)."""
    local = local_path(source)
    if local is not None:
        check_checkpoint(local, what)
        return
    from trace_core.store.artifacts import open_store

    store = open_store(str(source))
    keys = {o.key for o in store.list_objects("")}
    if not keys:
        raise FileNotFoundError(f"{what} {source}: nothing there (no such folder or prefix)")
    if "config.json" not in keys:
        raise CheckpointError(f"{what} {source} is not a model checkpoint: it has no config.json")
    if WEIGHTS in keys:
        return
    if WEIGHTS_INDEX in keys:
        try:
            shards = set(json.loads(store.get_bytes(WEIGHTS_INDEX))["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{store.uri(WEIGHTS_INDEX)}: not a safetensors index (no weight_map)"
            ) from None
        missing = sorted(str(name) for name in shards if name not in keys)
        if missing:
            raise CheckpointError(f"{store.uri(WEIGHTS_INDEX)} names {missing[0]}, not stored")
        return
    pickled = sorted(k for k in keys if k.lower().endswith(PICKLE_SUFFIXES))
    also = f" (only pickled weights, which are not loaded: {', '.join(pickled[:3])})"
    raise CheckpointError(
        f"{what} {source} has no {WEIGHTS} or {WEIGHTS_INDEX}" + (also if pickled else "")
    )


def upload_model(
    folder: Path, uri: str, progress: Callable[[int, int], None] | None = None
) -> tuple[int, int]:
    """Every file of the HF folder ``folder`` (hidden ones aside) to the same keys below
    ``uri``, where ``base_model_uri`` reads it; returns the files and bytes sent.

    The folder is checked first (``policy.checkpoint``; pickled weights are refused), then
    ``uri``: a prefix that holds files is never written into. ``config.json`` goes last, so a
    prefix without it never held a whole upload; an upload that fails removes what it sent.
    ``progress(sent, total)``: bytes sent so far, over all files."""
    if not is_remote(uri):
        raise ValueError(f"{uri}: expected an s3:// prefix (a local folder is a base_model_uri)")
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointError(f"DIR {root} {'is not a folder' if root.exists() else 'not found'}")
    files = sorted(
        (
            p
            for p in root.rglob("*")
            if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts)
        ),
        key=lambda p: (p == root / "config.json", p.as_posix()),
    )
    pickled = [p.relative_to(root).as_posix() for p in files if p.suffix.lower() in PICKLE_SUFFIXES]
    if pickled:
        raise CheckpointError(
            f"DIR {root} holds pickled weights ({', '.join(pickled[:3])}), which are never "
            "loaded or uploaded: convert them to safetensors, or remove them, and upload again"
        )
    check_checkpoint(root, "DIR")
    from trace_core.store.artifacts import open_store

    store = open_store(uri)
    held = store.list_objects("")
    if held:
        raise FileExistsError(
            f"{store.uri()} already holds {len(held)} file(s) ({held[0].key}, ...); an upload "
            "never writes over stored files: choose another prefix"
        )
    total, sent, done = sum(p.stat().st_size for p in files), 0, []
    try:
        for path in files:

            def report(n: int, before: int = sent) -> None:
                if progress:
                    progress(before + n, total)

            key = path.relative_to(root).as_posix()
            store.put_file(key, path, progress=report)
            done.append(key)
            sent += path.stat().st_size
            if progress:
                progress(sent, total)
    except BaseException:
        for key in done:  # this upload's own files: the prefix held nothing before it
            with contextlib.suppress(Exception):
                store.delete(key)
        raise
    return len(files), total
