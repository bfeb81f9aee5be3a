"""Radix tree: property tests against a dictionary-of-prefixes reference, locking, deep paths."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixgen.engine.kv_pool import SlotAllocator
from radixgen.radix import RadixTree

# Small alphabet so sequences share prefixes often.
token_seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), token_seqs),
        st.tuples(st.just("match"), token_seqs),
        st.tuples(st.just("lock"), token_seqs),
        st.tuples(st.just("unlock"), st.integers(0, 100)),
        st.tuples(st.just("evict"), st.integers(1, 20)),
    ),
    max_size=50,
)


class Reference:
    """Every cached prefix (as a tuple) -> the slot of its last token."""

    def __init__(self) -> None:
        self.slot_of: dict[tuple[int, ...], int] = {}

    def longest(self, seq: list[int]) -> list[int]:
        slots = []
        for i in range(1, len(seq) + 1):
            s = self.slot_of.get(tuple(seq[:i]))
            if s is None:
                break
            slots.append(s)
        return slots


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_agree_with_reference_and_conserve_slots(operations: list[tuple[str, object]]) -> None:
    pool = SlotAllocator(200)
    tree, ref = RadixTree(), Reference()
    locks: list[tuple[int, np.ndarray]] = []  # (node, slots protected by the lock)
    for op, arg in operations:
        if op == "insert":
            seq = list(arg)  # type: ignore[call-overload]
            slots = pool.alloc(len(seq))
            if slots is None:
                continue
            existing = tree.insert(seq, slots)
            assert existing == len(ref.longest(seq))
            pool.free(slots[:existing])  # duplicates of what the tree already had
            for i in range(existing, len(seq)):
                ref.slot_of[tuple(seq[: i + 1])] = int(slots[i])
        elif op in ("match", "lock"):
            seq = list(arg)  # type: ignore[call-overload]
            m = tree.match_prefix(seq)
            assert m.slots.tolist() == ref.longest(seq)
            if op == "lock" and m.length:
                tree.lock(m.node)
                locks.append((m.node, m.slots.copy()))
        elif op == "unlock" and locks:
            node, _ = locks.pop(int(arg) % len(locks))  # type: ignore[call-overload]
            tree.unlock(node)
        elif op == "evict":
            before = tree.evictable_tokens()
            freed = tree.evict(int(arg))  # type: ignore[call-overload]
            assert len(freed) >= min(int(arg), before)  # type: ignore[call-overload]
            protected = set(np.concatenate([s for _, s in locks]).tolist()) if locks else set()
            assert not protected & set(freed.tolist()), "a locked path was evicted"
            pool.free(freed)
            gone = set(freed.tolist())
            ref.slot_of = {k: v for k, v in ref.slot_of.items() if v not in gone}
        # invariants after every operation
        held = tree.all_slots()
        assert len(np.unique(held)) == len(held), "a slot is held twice"
        assert pool.available() + len(held) == 200, "slots lost or double-counted"
        assert tree.cached_tokens() == len(held) == len(ref.slot_of)
        assert all(k[:-1] in ref.slot_of for k in ref.slot_of if len(k) > 1), "cache must stay prefix-closed"
        # eviction's candidate set, kept up to date, is what a scan of the tree finds
        assert tree._evictable_leaves == {n for n in tree._leaves() if tree.lock_ref[n] == 0}


def test_split_on_partial_match_and_lock_counts() -> None:
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], np.array([10, 11, 12, 13])) == 0
    m = tree.match_prefix([1, 2, 9])
    assert m.slots.tolist() == [10, 11]
    assert tree.num_nodes() == 3  # root, [1,2], [3,4]
    tree.lock(m.node)
    assert tree.evictable_tokens() == 2
    assert tree.evict(10).tolist() == [12, 13]
    assert tree.evict(10).size == 0, "the locked prefix stays"
    tree.unlock(m.node)
    assert sorted(tree.evict(10).tolist()) == [10, 11]
    assert tree.cached_tokens() == 0


def test_lru_order_of_eviction() -> None:
    tree = RadixTree()
    tree.insert([1, 1], np.array([1, 2]))
    tree.insert([2, 2], np.array([3, 4]))
    tree.insert([3, 3], np.array([5, 6]))
    tree.match_prefix([1, 1])  # touch: now [2, 2] is the least recently used
    assert tree.evict(1).tolist() == [3, 4]
    assert tree.evict(1).tolist() == [5, 6]


def test_paths_thousands_of_tokens_deep() -> None:
    tree = RadixTree()
    depth = 5000
    seq = list(range(depth))
    tree.insert(seq, np.arange(depth) + 1)
    for k in range(depth - 1, 0, -1):  # split from the end: one node per token, a 5000-deep path
        tree.match_prefix(seq[:k])
    assert tree.num_nodes() == depth + 1
    m = tree.match_prefix(seq)
    assert m.length == depth and m.slots.tolist() == list(range(1, depth + 1))
    tree.lock(m.node)
    assert tree.evict(10**9).size == 0
    tree.unlock(m.node)
    freed = tree.evict(10**9)
    assert tree.cached_tokens() == 0 and sorted(freed.tolist()) == list(range(1, depth + 1))
