"""``PrefixCache``: a radix tree over token ids whose nodes own slots of one preallocated KV pool.

As SGLang's RadixAttention. Each node holds a run of tokens and the *slots* of their keys and
values in the pool (``capacity`` slots of ``(layers, 2, kv_heads, head_dim)``, keys and values
side by side as in ``KVCache``). A node's KV depends
only on the path from the root, so any prompt that walks through a node reuses it. Nodes on the
paths of a call in flight are locked (``acquire``/``release``); when the pool is full, unlocked
leaves are evicted, least recently used first. ``TorchEngine`` fills the slots; this module only
keeps the tree and the pool's bookkeeping.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from trace_core.policy.decoder import DecoderWeights


class Node:
    """A run of tokens in the radix tree; ``slots`` is None while the node is pending."""

    __slots__ = ("children", "last_used", "parent", "refs", "slots", "tokens")

    def __init__(
        self, tokens: tuple[int, ...], slots: torch.Tensor | None, parent: Node | None
    ) -> None:
        self.tokens = tokens
        self.slots = slots  # (len(tokens),) pool indices on the pool's device; None: pending
        self.parent = parent
        self.children: dict[int, Node] = {}  # keyed by the child's first token
        self.refs = 0  # calls in flight that need this node (locked when > 0)
        self.last_used = 0

    def ancestry(self) -> list[Node]:
        """The path from the root (excluded) down to this node (included)."""
        path, node = [], self
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]


class PrefixCache:
    """Radix tree over token ids whose nodes own slots of a preallocated KV pool.

    The pool holds ``capacity`` tokens; slot ``i`` is ``kv[:, :, i]``, its keys and values
    ``(layers, 2, kv_heads, head_dim)``. Paths are found by walking tokens, never kept across
    inserts: an insert may split a node, and the old node object then holds only its tail.
    """

    def __init__(self, weights: DecoderWeights, capacity: int) -> None:
        s = weights.spec
        shape = (s.num_layers, 2, capacity, s.num_kv_heads, s.head_dim)  # (L, 2, S, Hkv, D)
        self.kv = torch.zeros(shape, device=weights.device, dtype=weights.dtype)
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self._empty = torch.empty(0, dtype=torch.long, device=self.kv.device)
        self.root = Node((), self._empty, None)
        self._free = torch.arange(self.capacity, device=self.kv.device)
        self._clock = itertools.count(1)
        self.evicted_tokens = 0

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    # -- structure ---------------------------------------------------------------------------

    def insert(self, tokens: tuple[int, ...]) -> list[Node]:
        """The path of nodes spelling ``tokens``, ending exactly at ``len(tokens)``.

        Nodes are split where the path must end or branch; the tokens no node held become one
        new pending leaf (``slots`` None) that the caller fills or ``discard``s.
        """
        now = next(self._clock)
        node, i, path = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = Node(tokens[i:], None, node)
                node.children[tokens[i]] = child
            else:
                n = len(child.tokens)
                if tokens[i : i + n] != child.tokens:
                    n = _common_prefix(child.tokens, tokens, i)
                    child = self._split(child, n)
            child.last_used = now
            path.append(child)
            node, i = child, i + len(child.tokens)
        return path

    def _split(self, node: Node, n: int) -> Node:
        """Cut ``node`` after ``n`` tokens and return the new upper part."""
        assert node.parent is not None and 0 < n < len(node.tokens)
        top = Node(node.tokens[:n], None if node.slots is None else node.slots[:n], node.parent)
        top.refs, top.last_used = node.refs, node.last_used  # locks hold on both halves
        node.parent.children[node.tokens[0]] = top
        node.tokens = node.tokens[n:]
        node.slots = None if node.slots is None else node.slots[n:]
        node.parent = top
        top.children[node.tokens[0]] = node
        return top

    def walk(self, tokens: tuple[int, ...]) -> list[Node]:
        """The existing path that ends exactly at ``len(tokens)`` (as ``insert`` left it)."""
        node, i, path = self.root, 0, []
        while i < len(tokens):
            node = node.children[tokens[i]]
            i += len(node.tokens)
            path.append(node)
        if i != len(tokens):
            raise KeyError("the path does not end at a node boundary")
        return path

    def acquire(self, tokens: tuple[int, ...]) -> None:
        now = next(self._clock)
        for node in self.walk(tokens):
            node.refs += 1
            node.last_used = now

    def release(self, tokens: tuple[int, ...]) -> None:
        for node in self.walk(tokens):
            node.refs -= 1

    def discard(self, nodes: Sequence[Node]) -> None:
        """Remove nodes of a failed fill (deepest first), returning any slots they took."""
        for node in sorted(nodes, key=lambda x: -len(x.ancestry())):
            parent = node.parent
            if node.children or parent is None or parent.children.get(node.tokens[0]) is not node:
                continue
            del parent.children[node.tokens[0]]
            if node.slots is not None:
                self._free = torch.cat([self._free, node.slots])

    def slots_of(self, path: Sequence[Node]) -> torch.Tensor:
        """The pool slots of a path's tokens, in order (c,)."""
        parts = [n.slots for n in path]
        if any(p is None for p in parts):
            raise RuntimeError("the path has pending nodes")
        return torch.cat([self._empty, *parts])  # type: ignore[list-item]

    # -- slots -------------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slots, evicting least recently used unlocked leaves; None if impossible."""
        if n > len(self._free):
            self._evict(n - len(self._free))
        if n > len(self._free):
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def _evict(self, need: int) -> None:
        def evictable(node: Node) -> bool:
            return (
                node.parent is not None
                and not node.children
                and node.refs == 0
                and node.slots is not None
            )

        heap = [(n.last_used, id(n), n) for n in self._nodes() if evictable(n)]
        heapq.heapify(heap)
        freed = []
        while need > 0 and heap:
            _, _, node = heapq.heappop(heap)
            assert node.parent is not None and node.slots is not None
            del node.parent.children[node.tokens[0]]
            freed.append(node.slots)
            need -= len(node.tokens)
            self.evicted_tokens += len(node.tokens)
            if evictable(node.parent):
                heapq.heappush(heap, (node.parent.last_used, id(node.parent), node.parent))
        self._free = torch.cat([self._free, *freed])

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], offset: int) -> int:
    n = 0
    while n < len(a) and offset + n < len(b) and a[n] == b[offset + n]:
        n += 1
    return n
