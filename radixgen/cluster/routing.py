"""Which replica serves a request: round-robin, or prefix affinity with bounded imbalance.

A replica's radix cache only helps requests that reach it, so a router that sends requests
sharing a prefix to the same replica multiplies the cluster's hit rate (SGLang's cache-aware
router and llm-d's KV-aware scheduler do this). ``PrefixAffinity`` keeps an approximate index
of recent prefixes: the prompt is cut into fixed blocks, each block's hash chains the hashes
before it (so one hash names a whole prefix, as vLLM's prefix-caching block hashes do), and a
bounded LRU map remembers which replica last served each hash. A request goes to the replica
holding its longest remembered prefix unless that replica is overloaded against the least
loaded one; otherwise, and when nothing matches, to the least loaded replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class Router(Protocol):
    name: str

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica (index into ``loads``) for this prompt. ``loads``: requests in flight per
        replica; a replica marked unavailable has a load of ``UNAVAILABLE``."""
        ...

    def forget_replica(self, replica: int) -> None:
        """The replica lost its cache (restarted): stop sending prefixes to it for that reason."""
        ...


UNAVAILABLE = 1 << 30


class RoundRobin:
    """The baseline: replicas in turn, skipping unavailable ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        for _ in range(len(loads)):
            replica = self._next % len(loads)
            self._next += 1
            if loads[replica] < UNAVAILABLE:
                return replica
        return self._next % len(loads)

    def forget_replica(self, replica: int) -> None:
        pass


class PrefixAffinity:
    name = "prefix-affinity"

    def __init__(self, *, block_size: int = 16, max_entries: int = 200_000, balance_abs: int = 8,
                 balance_rel: float = 1.5) -> None:
        """``balance_abs`` / ``balance_rel``: the prefix's replica is skipped when its load exceeds
        the least loaded replica's by more than ``balance_abs`` requests and ``balance_rel`` times
        (both, so a few requests more on a small load is not an imbalance)."""
        self.block_size = block_size
        self.max_entries = max_entries
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self.matched_tokens = 0
        self.prompt_tokens = 0

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """One hash per whole block, each covering the prompt from its start."""
        hashes, running = [], 0
        for end in range(self.block_size, len(prompt_ids) + 1, self.block_size):
            running = hash((running, tuple(prompt_ids[end - self.block_size : end])))
            hashes.append(running)
        return hashes

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        hashes = self.block_hashes(prompt_ids)
        # ties between equally loaded replicas are broken by the prompt's first block, so idle
        # replicas take different prefixes rather than all going to replica 0
        start = (hashes[0] if hashes else hash(tuple(prompt_ids))) % len(loads)
        least = min(range(len(loads)), key=lambda r: (loads[r], (r - start) % len(loads)))
        chosen, matched = least, 0
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner < len(loads) and loads[owner] < UNAVAILABLE:
                if not self._imbalanced(loads[owner], loads[least]):
                    chosen, matched = owner, depth * self.block_size
                break
        self.matched_tokens += matched
        self.prompt_tokens += len(prompt_ids)
        for h in hashes:  # the chosen replica will hold this whole prompt in its cache
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen

    def _imbalanced(self, load: int, least: int) -> bool:
        return load - least > self.balance_abs and load > self.balance_rel * least

    def forget_replica(self, replica: int) -> None:
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]


def make_router(name: str) -> Router:
    if name == "prefix-affinity":
        return PrefixAffinity()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"routing must be 'prefix-affinity' or 'round-robin', got {name!r}")
