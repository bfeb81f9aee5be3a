from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixgen.engine.kv_pool import PAD_SLOT, KVPool, SlotAllocator


def test_alloc_returns_distinct_slots_and_none_when_short() -> None:
    alloc = SlotAllocator(10)
    a = alloc.alloc(4)
    b = alloc.alloc(6)
    assert a is not None and b is not None
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(1, 11)), "slot 0 is reserved"
    assert alloc.alloc(1) is None
    assert alloc.available() == 0
    alloc.free(a)
    assert alloc.available() == 4
    assert alloc.alloc(5) is None, "a failed alloc must not take anything"
    assert alloc.available() == 4


def test_double_free_is_caught() -> None:
    alloc = SlotAllocator(8)
    slots = alloc.alloc(3)
    assert slots is not None
    alloc.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots[:1])
    with pytest.raises(AssertionError, match="pad slot"):
        alloc.free(np.array([PAD_SLOT]))
    assert alloc.available() == 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=60))
def test_random_alloc_free_keeps_every_slot_accounted(ops: list[tuple[bool, int]]) -> None:
    alloc = SlotAllocator(32)
    held: list[np.ndarray] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            got = alloc.alloc(n)
            if got is not None:
                held.append(got)
        else:
            alloc.free(held.pop(n % len(held)))
        owned = np.concatenate(held) if held else np.array([], dtype=np.int64)
        assert len(np.unique(owned)) == len(owned)
        assert alloc.available() + len(owned) == 32


def test_pool_shapes_and_req_to_token_write() -> None:
    import torch

    pool = KVPool(num_slots=16, num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32,
                  device="cpu", max_rows=4, max_context_len=32)
    assert pool.k.shape == (2, 17, 3, 8)
    slots = pool.slots.alloc(3)
    assert slots is not None
    pool.write(np.array([2, 2, 2]), np.array([0, 1, 2]), slots)
    assert pool.row_slots(2, 3).tolist() == slots.tolist()
    assert pool.req_to_token[2, :3].tolist() == slots.tolist(), "device view sees host writes"
    assert KVPool.bytes_per_token(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4


def test_a_rollback_past_the_computed_kv_keeps_what_was_computed() -> None:
    """A validator rejection inside tokens appended in the same step (a steered closing, a
    forced run) keeps more tokens than have KV: truncating there used to raise num_computed, so
    the release put never-written slots into the tree while they were also free (dep6: 38 slots
    owned twice, and later prompts read stale KV)."""
    import torch

    from radixgen import SamplingParams
    from radixgen.engine.kv_cache import KVCacheManager
    from radixgen.engine.kv_pool import KVPool
    from radixgen.engine.request import Request

    pool = KVPool(num_slots=64, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu",
                  max_rows=2, max_context_len=32)
    kv = KVCacheManager(pool, use_cache=True)
    req = Request("r", [1, 2, 3, 4], SamplingParams(max_new_tokens=8), rng_seed=0)
    kv.take_row(req, None)
    slots, _ = kv.alloc(6)
    assert slots is not None
    kv.place(req, slots)
    req.num_computed = 6  # the prompt and two output tokens have KV
    req.output_ids = [5, 6, 7, 8, 9]  # three more appended this step, none computed yet
    kv.truncate(req, len(req.prompt_ids) + 4 - 1)  # a rollback that keeps four output tokens
    assert req.num_computed == 6
    kv.truncate(req, 5)
    assert req.num_computed == 5 and pool.available() == 64 - 5
    kv.release(req, cache=True)
    kv.check_invariant([])
    assert kv.cached_tokens() == 5 and np.isin(slots[:5], kv.tree.all_slots()).all()


def test_a_cpu_pool_starts_with_a_zero_pad_slot_and_nothing_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left unfilled (the default outside the tests), a CPU pool is a fresh mapping: its pad slot
    reads as zeros without a write, and no layer's pages are faulted in by the start."""
    import re
    from pathlib import Path

    import torch

    from radixgen.engine import kv_pool

    monkeypatch.setattr(kv_pool, "UNWRITTEN_FILL", None)

    def resident_anon() -> int:
        text = Path("/proc/self/smaps_rollup").read_text()
        return int(re.search(r"^Anonymous:\s+(\d+)", text, re.M).group(1)) * 1024  # type: ignore[union-attr]

    before = resident_anon()
    pool = KVPool(num_slots=4095, num_layers=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu",
                  max_rows=4, max_context_len=64)  # 2 MiB a layer: a huge page each
    grew = resident_anon() - before
    assert grew < 4 << 20, f"{grew} bytes faulted in at the start"
    for cache in (pool.k, pool.v):
        assert not cache[:, PAD_SLOT].any()
