"""The huge-page arena the CPU engine keeps its weights and KV pool in."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from torch import nn

from radixgen.host_memory import HUGE_PAGE, WeightArena, huge_page_empty, move_into_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> list[str]:
    """The /proc/self/smaps lines of the mapping holding ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            if start <= address < end:
                block = [line]
                for rest in lines[i + 1 :]:
                    first = rest.split()[0]
                    if "-" in first and all(c in "0123456789abcdef-" for c in first):
                        break
                    block.append(rest)
                return block
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_empty_is_aligned_writable_and_advised() -> None:
    pool = huge_page_empty((3, 512, 1024), torch.float32)  # 6 MiB: whole huge pages
    assert pool.shape == (3, 512, 1024) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE == 0
    pool.fill_(2.5)
    assert float(pool[1].sum()) == 2.5 * 512 * 1024
    if not THP_MODE.exists() or "[never]" in THP_MODE.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    eligible = [line for line in _mapping_of(pool.data_ptr()) if line.startswith("THPeligible")]
    assert eligible and eligible[0].split()[1] == "1"


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(10, 4), requires_grad=False)
        self.head = nn.Linear(4, 10, bias=True)
        self.head.weight = self.embed  # tied, as a model's LM head
        self.register_buffer("table", torch.arange(12, dtype=torch.float64).view(3, 4))
        self.half = torch.randn(6, dtype=torch.bfloat16)  # not registered: not moved


def test_move_into_huge_pages_keeps_values_identity_and_ties() -> None:
    model = _Tied()
    embed, bias, table = model.embed, model.head.bias, model.table
    before = {name: t.clone() for name, t in [("embed", embed), ("bias", bias), ("table", table)]}
    old_ptr = embed.data_ptr()
    moved = move_into_huge_pages([*model.parameters(), *model.buffers()])
    assert moved >= 10 * 4 * 4 + 10 * 4 + 12 * 8
    assert model.embed is embed and model.head.weight is model.embed and model.head.bias is bias
    assert embed.data_ptr() != old_ptr
    torch.testing.assert_close(embed, before["embed"], rtol=0, atol=0)
    torch.testing.assert_close(bias, before["bias"], rtol=0, atol=0)
    torch.testing.assert_close(model.table, before["table"], rtol=0, atol=0)
    # one arena: every tensor lies in the same storage, at cache-line boundaries
    storages = {t.untyped_storage().data_ptr() for t in (embed, bias, model.table)}
    assert len(storages) == 1
    assert all(t.data_ptr() % 64 == 0 for t in (embed, bias, model.table))
    x = torch.randn(2, 4)
    torch.testing.assert_close(model.head(x), x @ before["embed"].T + before["bias"])


def test_views_of_one_storage_stay_views() -> None:
    base = torch.arange(20, dtype=torch.float32)
    first, second = base[:10].view(2, 5), base[5:15]
    move_into_huge_pages([first, second])
    second[0] = -1.0  # element 5 of the old storage: row 1, column 0 of ``first``
    assert float(first[1, 0]) == -1.0
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def _resident_bytes(address: int) -> int:
    """Rss of the mapping holding ``address``."""
    (line,) = [ln for ln in _mapping_of(address) if ln.startswith("Rss:")]
    return int(line.split()[1]) * 1024


def test_a_weight_arena_hands_out_aligned_tensors_in_order_until_full() -> None:
    sizes = [1000, 64, 4096 * 3]
    arena = WeightArena(WeightArena.bytes_for(sizes))
    assert arena.bytes.numel() == 1024 + 64 + 4096 * 3
    first = arena.take((1000,))
    second = arena.take((16,), torch.float32)
    third = arena.take((3, 1024), torch.float32)
    assert first is not None and second is not None and third is not None
    assert [t.data_ptr() - arena.bytes.data_ptr() for t in (first, second, third)] == [0, 1024, 1088]
    assert third.shape == (3, 1024) and third.dtype == torch.float32 and third.is_contiguous()
    assert arena.used == arena.bytes.numel() and all(arena.holds(t) for t in (first, second, third))
    assert arena.take((1,)) is None, "a full arena hands out nothing (the caller allocates elsewhere)"
    assert not arena.holds(torch.empty(8))


def test_populating_an_arena_faults_it_in_and_keeps_what_was_written() -> None:
    if platform.system() != "Linux" or tuple(map(int, platform.release().split(".")[:2])) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    arena = WeightArena(8 * HUGE_PAGE)
    written = arena.take((HUGE_PAGE // 4,), torch.float32)
    assert written is not None
    written.copy_(torch.arange(HUGE_PAGE // 4, dtype=torch.float32))
    before = _resident_bytes(arena.bytes.data_ptr())
    arena.populate_in_background()
    arena.wait_populated()
    after = _resident_bytes(arena.bytes.data_ptr())
    assert before < 8 * HUGE_PAGE <= after, (before, after)
    assert torch.equal(written, torch.arange(HUGE_PAGE // 4, dtype=torch.float32))


def test_moving_into_huge_pages_leaves_what_an_arena_placed() -> None:
    arena = WeightArena(4096)
    placed = arena.take((1024,), torch.float32)
    assert placed is not None
    placed.fill_(3.0)
    loose = torch.full((10,), 2.0)
    address = placed.data_ptr()
    moved = move_into_huge_pages([placed, loose], placed=arena)
    assert placed.data_ptr() == address and float(placed.sum()) == 3.0 * 1024
    assert moved == 64 and not arena.holds(loose) and float(loose.sum()) == 20.0


def test_an_arena_hands_back_the_huge_pages_past_what_was_taken() -> None:
    if platform.system() != "Linux" or tuple(map(int, platform.release().split(".")[:2])) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    arena = WeightArena(8 * HUGE_PAGE)
    taken = arena.take((3 * HUGE_PAGE // 2,))
    assert taken is not None
    taken.fill_(7)
    arena.populate_in_background()
    arena.wait_populated()
    assert _resident_bytes(arena.bytes.data_ptr()) >= 8 * HUGE_PAGE
    assert arena.release_unused() == 6 * HUGE_PAGE  # past the second huge page, which holds the taken tail
    assert _resident_bytes(arena.bytes.data_ptr()) <= 2 * HUGE_PAGE
    assert int(taken.min()) == 7 == int(taken.max())
