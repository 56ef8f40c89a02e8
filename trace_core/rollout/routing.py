"""How a Ray engine pool routes prompts (``rollout.ray_pool``): which worker served a prompt's
longest known prefix (``PrefixOwners``), how a call's work is split across workers
(``split_work``). Pure functions and data, no Ray: the routing rules
are the module docstring of ``rollout.ray_pool``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd: its powers never vanish mod 2^64
_LENGTH_MIX = np.uint64(0xC2B2AE3D27D4EB4F)


class PrefixOwners:
    """Which worker served a token sequence, found by the longest known prefix.

    Every recorded sequence is keyed by its length and a polynomial hash mod 2^64 of its
    tokens, ``h(t[:k]) = Σ_{i<k} (t_i + 1) · B^i``, so the hashes of all prefixes of a new
    prompt come from one cumulative sum, and only the lengths that were recorded need a
    look-up. A collision only misroutes a prompt (slower, never wrong). Holds at most
    ``capacity`` sequences; the oldest half is forgotten when it is full.
    """

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self._owner: dict[int, int] = {}  # mixed (length, hash) -> worker
        self._lengths: set[int] = set()  # lengths of the recorded sequences
        self._sorted: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._powers = np.ones(1, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._owner)

    def clear(self) -> None:
        self._owner.clear()
        self._lengths.clear()
        self._sorted = np.zeros(0, dtype=np.int64)

    def _prefix_hashes(self, tokens: Sequence[int]) -> npt.NDArray[np.uint64]:
        """(len + 1,) hashes of every prefix, the empty one first."""
        n = len(tokens)
        if len(self._powers) < n:
            powers, p = [], 1
            for _ in range(max(n, 2 * len(self._powers))):
                powers.append(p)
                p = p * _BASE & _MASK
            self._powers = np.array(powers, dtype=np.uint64)
        out = np.zeros(n + 1, dtype=np.uint64)
        t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
        np.cumsum(t * self._powers[:n], out=out[1:])  # wraps mod 2^64, as intended
        return out

    @staticmethod
    def _keys(lengths: npt.NDArray[np.int64], hashes: npt.NDArray[np.uint64]) -> list[int]:
        return (hashes ^ (lengths.astype(np.uint64) * _LENGTH_MIX)).tolist()  # type: ignore[no-any-return]

    def record(self, tokens: Sequence[int], worker: int) -> None:
        n = len(tokens)
        key = self._keys(np.array([n]), self._prefix_hashes(tokens)[n:])[0]
        self._lengths.add(n)  # a new length makes _sorted stale: rebuilt on the next look-up
        self._owner[key] = worker
        if len(self._owner) > self.capacity:
            self._forget_oldest_half()

    def lookup(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """(worker, prefix length) of the longest recorded prefix of ``tokens``; (None, 0)."""
        if not self._owner:
            return None, 0
        if len(self._sorted) != len(self._lengths):
            self._sorted = np.array(sorted(self._lengths), dtype=np.int64)
        lengths = self._sorted[: np.searchsorted(self._sorted, len(tokens), side="right")]
        keys = self._keys(lengths, self._prefix_hashes(tokens)[lengths])
        for k in range(len(keys) - 1, -1, -1):
            worker = self._owner.get(keys[k])
            if worker is not None:
                return worker, int(lengths[k])
        return None, 0

    def _forget_oldest_half(self) -> None:
        # Lengths cannot be recovered from mixed keys, so the length index keeps them all:
        # a length with no sequence left only costs a look-up that misses.
        items = list(self._owner.items())
        self._owner = dict(items[len(items) // 2 :])


@dataclass(frozen=True)
class SubBatch:
    """Prompts ``indices`` of a call, sent to ``worker`` with their own ``seeds``."""

    worker: int
    indices: tuple[int, ...]
    seeds: tuple[int, ...]
    work: float


def split_work(
    owners: Sequence[int | None],
    home_work: Sequence[float],
    away_work: Sequence[float],
    workers: Sequence[int],
    slack: float,
    queued: Mapping[int, float] | None = None,
) -> list[int]:
    """The worker of each group. Owned groups stay home, heaviest first, while the owner's
    load stays under the fair share × (1 + slack). The rest, heaviest first, go where they
    would finish first: the least load after adding their work there (their home work at
    home, their away work elsewhere), the greedy rule for machines of unequal cost.
    ``queued``: work each worker already has (a streaming driver's turns in flight), counted
    in its load and in the fair share."""
    load = {w: float((queued or {}).get(w, 0.0)) for w in workers}
    cap = (sum(home_work) + sum(load.values())) / len(workers) * (1 + slack)
    chosen: list[int] = [-1] * len(owners)
    rest = []
    for g in sorted(range(len(owners)), key=lambda g: -home_work[g]):
        owner = owners[g]
        if owner in load and load[owner] + home_work[g] <= cap:
            chosen[g] = owner
            load[owner] += home_work[g]
        else:
            rest.append(g)
    for g in sorted(rest, key=lambda g: -away_work[g]):

        def cost(w: int, g: int = g) -> float:
            return home_work[g] if owners[g] == w else away_work[g]

        w = min(workers, key=lambda w: (load[w] + cost(w), w))
        chosen[g] = w
        load[w] += cost(w)
    return chosen
