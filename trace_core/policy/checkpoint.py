"""What a policy checkpoint folder must hold, checked before Hugging Face sees it.

    check_checkpoint("build/policy/calc")          # the folder, or a ValueError naming what is off
    tokenizer = load_tokenizer("build/policy/calc")

A checkpoint is an HF directory: ``config.json`` (a JSON object with a ``model_type``), the
weights as safetensors (``model.safetensors``, or the shards an index names) and the tokenizer
(``tokenizer.json`` or ``tokenizer_config.json``). The check reads each weights file's header
only (8 bytes of length, then a JSON table of tensors and their byte ranges), so a truncated
file is caught without reading its data. Without this, HF reports a missing folder as a bad
repo id and a truncated file as a bare ``SafetensorError``. Importable without torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the header
HINT = "pass a folder written by `trace-rl warmstart`, a run's policy/ or an HF model"

UPSTREAM = (
    "transformers.AutoTokenizer.from_pretrained(pretrained_model_name_or_path, /, "
    "local_files_only)",
)
"""What this module calls in transformers (``policy.upstream``: entry syntax there)."""


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete or damaged; the message names the file."""


def check_checkpoint(path: str | Path, what: str = "checkpoint") -> Path:
    """``path`` as a Path if it holds a loadable checkpoint; else a ``CheckpointError``."""
    folder = _check_folder(path, what)
    _read_config(folder)
    for shard in _weight_files(folder):
        check_safetensors(shard)
    _check_tokenizer_files(folder, what)
    return folder


def load_tokenizer(path: str | Path, what: str = "checkpoint") -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint folder (only its tokenizer files need be there)."""
    from transformers import AutoTokenizer

    folder = _check_folder(path, what)
    _check_tokenizer_files(folder, what)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: the tokenizer does not load ({err})") from None


def _check_folder(path: str | Path, what: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        kind = "is not a folder" if folder.exists() else "does not exist"
        raise CheckpointError(f"{what} {folder} {kind}; {HINT}")
    return folder


def _check_tokenizer_files(folder: Path, what: str) -> None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{what} {folder} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); {HINT}"
        )


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose tensors all lie inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes, no safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: damaged or truncated (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{path}: damaged (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: damaged (the header is not a JSON object)")
    ends = [
        int(entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    data = size - 8 - length
    if max(ends, default=0) > data:
        raise CheckpointError(
            f"{path}: truncated ({data} bytes of tensor data, the header needs {max(ends)}); "
            "copy the checkpoint again"
        )


def _read_config(folder: Path) -> dict[str, object]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a model checkpoint: it has no config.json")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: not a model config (no model_type field)")
    return config


def _weight_files(folder: Path) -> list[Path]:
    single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
    if single.is_file():
        return [single]
    if not index.is_file():
        names = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        pickled = f" (only pickled weights, which are not loaded: {', '.join(names)})"
        raise CheckpointError(
            f"{folder} has no {WEIGHTS} or {WEIGHTS_INDEX}" + (pickled if names else "")
        )
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index}: not a safetensors index (no weight_map)") from None
    paths = [folder / str(name) for name in shards]
    for shard in paths:
        if shard.parent != folder or not shard.is_file():
            raise CheckpointError(f"{index} names {shard.name}, which is not in {folder}")
    return paths
