"""The KV cache manager: the only code that touches the KV pool and the radix tree.

A request's KV lives in its req_to_token row: the slots of its cached prefix (``prefix_len``
tokens, owned by the tree and locked at ``last_node`` while it runs) and then the slots it
computed itself (owned by the request). Everything else in the pool is free or the tree's;
``check_invariant`` proves that no slot is lost or owned twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixgen.engine.kv_pool import KVPool
from radixgen.engine.request import Request
from radixgen.engine.row_params import RowParams
from radixgen.radix import MatchResult, RadixTree


class KVCacheManager:
    def __init__(self, pool: KVPool, use_cache: bool) -> None:
        self.pool = pool
        self.tree = RadixTree()
        self.use_cache = use_cache
        self.row_params = RowParams(pool.req_to_token_host.shape[0])
        """The request constants of each row's holder (sampling, stops), kept with the rows."""

    # ---- room ---------------------------------------------------------------------------

    def room(self) -> int:
        """Slots a step could take: the free ones and the tree's evictable ones."""
        return self.pool.available() + self.tree.evictable_tokens()

    def short_of(self, need: int) -> bool:
        return self.room() < need

    def has_free_row(self) -> bool:
        return self.pool.rows.available() > 0

    def alloc(self, n: int) -> tuple[np.ndarray | None, int]:
        """``n`` free slots (evicting unlocked tree leaves if needed), or None; and how many
        cached tokens were evicted for them."""
        short = n - self.pool.available()
        evicted = 0
        if short > 0 and self.use_cache:
            freed = self.tree.evict(short)
            self.pool.slots.free(freed)
            evicted = len(freed)
        return self.pool.slots.alloc(n), evicted

    # ---- prefixes -----------------------------------------------------------------------

    def peek_prefix_len(self, tokens: list[int]) -> int:
        return self.tree.peek_prefix_len(tokens) if self.use_cache else 0

    def match(self, tokens: list[int]) -> MatchResult | None:
        return self.tree.match_prefix(tokens) if self.use_cache else None

    def take_row(self, req: Request, match: MatchResult | None) -> int:
        """Give ``req`` a row holding its cached prefix (locked); return the prefix's length."""
        req.pool_row = self.pool.rows.alloc()
        self.row_params.assign(req.pool_row, req)
        prefix = match.length if match is not None else 0
        if match is not None and prefix:
            self.tree.lock(match.node)
            req.last_node = match.node
            self.pool.write(np.full(prefix, req.pool_row), np.arange(prefix), match.slots)
        req.prefix_len = req.num_computed = prefix
        return prefix

    def place(self, req: Request, slots: np.ndarray) -> None:
        """Put freshly allocated slots in ``req``'s row after what it has computed."""
        start = req.num_computed
        self.pool.write(np.full(len(slots), req.pool_row), np.arange(start, start + len(slots)), slots)

    def write(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        self.pool.write(rows, positions, slots)

    def slots_at(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self.pool.req_to_token_host[rows, positions]

    def cache_computed_prefix(self, req: Request) -> None:
        """Insert a request's freshly prefilled tokens into the tree now, not at its end, so
        requests arriving while it still runs share its prompt. The request then holds the tree's
        slots for that prefix (locked), and frees any it computed twice."""
        n = req.num_computed
        tokens = req.all_ids()[:n]
        slots = self.pool.row_slots(req.pool_row, n).copy()
        existing = self.tree.insert(tokens, slots)
        match = self.tree.match_prefix(tokens)
        assert match.length == n, "a just-inserted sequence must match in full"
        if existing > req.prefix_len:
            self.pool.slots.free(slots[req.prefix_len : existing])
            self.pool.write(np.full(existing, req.pool_row), np.arange(existing), match.slots[:existing])
        self.tree.lock(match.node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = match.node, n

    # ---- giving back --------------------------------------------------------------------

    def truncate(self, req: Request, computed: int) -> None:
        """Forget ``req``'s KV from position ``computed`` on (never its cached prefix). A
        ``computed`` past what was computed keeps it all: tokens appended in the step that rolls
        back (a steered closing, a forced run) have no KV yet."""
        keep = min(max(computed, req.prefix_len), req.num_computed)
        self.pool.slots.free(self.pool.row_slots(req.pool_row, req.num_computed)[keep:].copy())
        req.num_computed = keep

    def release(self, req: Request, cache: bool) -> None:
        """Give back ``req``'s row and slots; with ``cache`` its computed tokens go into the tree
        (what the tree already had, it computed twice: those slots are freed)."""
        if req.pool_row < 0:
            return
        n = req.num_computed
        slots = self.pool.row_slots(req.pool_row, n).copy()
        owned_from = req.prefix_len  # slots before this belong to the tree
        if cache and self.use_cache and n > 0:
            existing = self.tree.insert(req.all_ids()[:n], slots)
            assert existing >= req.prefix_len, "a locked prefix vanished from the tree"
            n = existing
        self.pool.slots.free(slots[owned_from:n])
        self.tree.unlock(req.last_node)
        self.pool.rows.free(req.pool_row)
        self.row_params.release(req.pool_row)
        req.pool_row = -1
        req.num_computed = req.prefix_len = req.last_node = 0

    def drop_unused_prefixes(self) -> int:
        """Evict every cached prefix no running request holds (a benchmark's cold start, an
        operator's flush); return how many tokens were dropped."""
        freed = self.tree.evict(self.tree.evictable_tokens())
        self.pool.slots.free(freed)
        return len(freed)

    # ---- accounting ---------------------------------------------------------------------

    def used(self) -> int:
        return self.pool.used()

    def cached_tokens(self) -> int:
        return self.tree.cached_tokens()

    @staticmethod
    def held_by(requests: Iterable[Request]) -> int:
        """KV slots owned by these requests (their cached prefixes belong to the tree)."""
        return sum(r.num_computed - r.prefix_len for r in requests if r.pool_row >= 0)

    def check_invariant(self, requests: Iterable[Request]) -> None:
        """free + owned by requests + owned by the tree == pool, with no slot in two places."""
        owned = [self.pool.row_slots(r.pool_row, r.num_computed)[r.prefix_len :] for r in requests if r.pool_row >= 0]
        tree_slots = self.tree.all_slots()
        free = self.pool.slots.free_slots()
        everything = np.concatenate([free, tree_slots, *owned])
        assert len(everything) == self.pool.num_slots, (
            f"free {len(free)} + tree {len(tree_slots)} + requests {sum(map(len, owned))} != pool {self.pool.num_slots}"
        )
        assert len(np.unique(everything)) == len(everything), "a KV slot is owned twice"
