"""Radix tree over token ids mapping cached prefixes to KV slots (RadixAttention).

Nodes live in an arena: parallel Python lists indexed by node id, with freed ids reused. Each
node's edge holds a token span (``keys[n]``, int64 array) and the KV slots of those tokens
(``values[n]``); children are found by the first token of their edge. Every walk is a loop, never
recursion, so paths thousands of tokens deep are fine.

Locking: a running request locks the node where its cached prefix ends; ``lock_ref`` counts
along the whole path to the root, and a node with ``lock_ref > 0`` is never evicted. The unlocked
leaves (eviction's candidates) are kept as a set, updated where a node's children or lock change,
so an eviction does not scan the whole tree.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

ROOT = 0


@dataclass(frozen=True)
class MatchResult:
    slots: np.ndarray  # [n] KV slots of the matched prefix, in order
    node: int  # the node where the match ends (lock this one)

    @property
    def length(self) -> int:
        return int(self.slots.shape[0])


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix; callers have already matched the first token."""
    n = min(len(a), len(b))
    if n <= 1:
        return n
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RadixTree:
    def __init__(self) -> None:
        self.parent: list[int] = [-1]
        self.children: list[dict[int, int]] = [{}]
        self.keys: list[np.ndarray] = [np.empty(0, dtype=np.int64)]
        self.values: list[np.ndarray] = [np.empty(0, dtype=np.int64)]
        self.lock_ref: list[int] = [1]  # the root is never evicted
        self.last_access: list[int] = [0]
        self._free_ids: list[int] = []
        self._clock = 0
        self._total_tokens = 0
        self._locked_tokens = 0
        self._evictable_leaves: set[int] = set()

    # ---- queries ------------------------------------------------------------------------

    def cached_tokens(self) -> int:
        return self._total_tokens

    def evictable_tokens(self) -> int:
        return self._total_tokens - self._locked_tokens

    def num_nodes(self) -> int:
        return len(self.parent) - len(self._free_ids)

    def match_prefix(self, tokens: np.ndarray | list[int]) -> MatchResult:
        """Longest cached prefix of ``tokens``; splits an edge that matches only partly, so the
        returned node ends exactly at the match."""
        tokens = np.asarray(tokens, dtype=np.int64)
        self._clock += 1
        node, pos = ROOT, 0
        pieces: list[np.ndarray] = []
        while pos < len(tokens):
            child = self.children[node].get(int(tokens[pos]))
            if child is None:
                break
            key = self.keys[child]
            m = _common_prefix_len(key, tokens[pos:])
            if m < len(key):
                child = self._split(child, m)
            self.last_access[child] = self._clock
            pieces.append(self.values[child])
            node, pos = child, pos + m
            if m < len(key):
                break
        slots = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        return MatchResult(slots=slots, node=node)

    def peek_prefix_len(self, tokens: list[int]) -> int:
        """Length of the cached prefix, without splitting edges or touching access times."""
        node, pos = ROOT, 0
        arr: np.ndarray | None = None
        while pos < len(tokens):
            child = self.children[node].get(tokens[pos])
            if child is None:
                break
            key = self.keys[child]
            if arr is None:
                arr = np.asarray(tokens, dtype=np.int64)
            m = _common_prefix_len(key, arr[pos:])
            pos += m
            if m < len(key):
                break
            node = child
        return pos

    # ---- updates ------------------------------------------------------------------------

    def insert(self, tokens: np.ndarray | list[int], slots: np.ndarray) -> int:
        """Cache ``slots`` for ``tokens``; return how many leading tokens were already cached.
        The caller still owns ``slots[:returned]`` (duplicates of the tree's) and must free those
        it does not otherwise hold; the rest now belong to the tree."""
        tokens = np.asarray(tokens, dtype=np.int64)
        assert len(tokens) == len(slots), "one slot per token"
        self._clock += 1
        node, pos = ROOT, 0
        while pos < len(tokens):
            child = self.children[node].get(int(tokens[pos]))
            if child is None:
                leaf = self._new_node(node, tokens[pos:].copy(), np.asarray(slots[pos:], dtype=np.int64).copy())
                self.last_access[leaf] = self._clock
                self._total_tokens += len(tokens) - pos
                return pos
            key = self.keys[child]
            m = _common_prefix_len(key, tokens[pos:])
            if m < len(key):
                child = self._split(child, m)
            self.last_access[child] = self._clock
            node, pos = child, pos + m
        return pos

    def lock(self, node: int) -> None:
        while node != ROOT:
            if self.lock_ref[node] == 0:
                self._locked_tokens += len(self.keys[node])
                self._evictable_leaves.discard(node)
            self.lock_ref[node] += 1
            node = self.parent[node]

    def unlock(self, node: int) -> None:
        while node != ROOT:
            assert self.lock_ref[node] > 0, f"unlock of unlocked node {node}"
            self.lock_ref[node] -= 1
            if self.lock_ref[node] == 0:
                self._locked_tokens -= len(self.keys[node])
                self._note_leaf(node)
            node = self.parent[node]

    def evict(self, num_tokens: int) -> np.ndarray:
        """Free at least ``num_tokens`` (if that many are evictable) from least recently used
        unlocked leaves, bottom-up; return the freed slots for the pool."""
        if num_tokens <= 0:
            return np.empty(0, dtype=np.int64)
        heap = [(self.last_access[n], n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[np.ndarray] = []
        count = 0
        while count < num_tokens and heap:
            _, leaf = heapq.heappop(heap)
            parent = self.parent[leaf]
            freed.append(self.values[leaf])
            count += len(self.values[leaf])
            self._total_tokens -= len(self.keys[leaf])
            self._remove_leaf(leaf)
            if parent != ROOT and not self.children[parent] and self.lock_ref[parent] == 0:
                heapq.heappush(heap, (self.last_access[parent], parent))
        return np.concatenate(freed) if freed else np.empty(0, dtype=np.int64)

    def all_slots(self) -> np.ndarray:
        """Every slot the tree holds (for accounting checks)."""
        vals = [self.values[n] for n in self._live_ids() if n != ROOT]
        return np.concatenate(vals) if vals else np.empty(0, dtype=np.int64)

    # ---- internals ----------------------------------------------------------------------

    def _live_ids(self) -> list[int]:
        free = set(self._free_ids)
        return [n for n in range(len(self.parent)) if n not in free]

    def _leaves(self) -> list[int]:
        return [n for n in self._live_ids() if n != ROOT and not self.children[n]]

    def _note_leaf(self, n: int) -> None:
        """Keep ``n``'s membership of the evictable-leaf set true after a change to it."""
        if n != ROOT and self.parent[n] >= 0 and not self.children[n] and self.lock_ref[n] == 0:
            self._evictable_leaves.add(n)
        else:
            self._evictable_leaves.discard(n)

    def _new_node(self, parent: int, key: np.ndarray, value: np.ndarray) -> int:
        if self._free_ids:
            n = self._free_ids.pop()
            self.parent[n], self.children[n], self.keys[n], self.values[n] = parent, {}, key, value
            self.lock_ref[n], self.last_access[n] = 0, self._clock
        else:
            n = len(self.parent)
            self.parent.append(parent)
            self.children.append({})
            self.keys.append(key)
            self.values.append(value)
            self.lock_ref.append(0)
            self.last_access.append(self._clock)
        self.children[parent][int(key[0])] = n
        self._note_leaf(n)
        self._evictable_leaves.discard(parent)  # it has a child now
        return n

    def _split(self, child: int, m: int) -> int:
        """Cut ``child``'s edge after m tokens; return the new upper node (inherits locks)."""
        assert 0 < m < len(self.keys[child])
        key, value = self.keys[child], self.values[child]
        upper = self._new_node(self.parent[child], key[:m], value[:m])
        self.lock_ref[upper] = self.lock_ref[child]  # same lockers; token counts are unchanged
        self.last_access[upper] = self.last_access[child]
        self.keys[child], self.values[child] = key[m:], value[m:]
        self.parent[child] = upper
        self.children[upper][int(key[m])] = child
        self._evictable_leaves.discard(upper)
        return upper

    def _remove_leaf(self, leaf: int) -> None:
        parent = self.parent[leaf]
        del self.children[parent][int(self.keys[leaf][0])]
        self.keys[leaf] = self.values[leaf] = np.empty(0, dtype=np.int64)
        self.children[leaf] = {}
        self.parent[leaf] = -1
        self._free_ids.append(leaf)
        self._evictable_leaves.discard(leaf)
        self._note_leaf(parent)
