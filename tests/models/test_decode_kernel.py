"""The native CPU decode-attention kernel against gather + SDPA on the same pool.

The kernel reads K/V through req_to_token instead of a gathered block; the cases cover what
that changes: slots scattered over the pool, requests of different lengths (down to one key),
GQA groups and plain multi-head, head sizes with and without a specialised loop, reduced
precision, and a row table whose rows are longer than any request.
"""

from __future__ import annotations

import pytest
import torch

from radixgen.kernels import decode_attention_op


@pytest.fixture(scope="module")
def kernel():
    op = decode_attention_op()
    if op is None:
        pytest.skip("the CPU decode-attention kernel does not build here")
    return op


def _reference(q, k_cache, v_cache, req_to_token, rows, seq_lens, window=0, softcap=0.0):
    batch, heads, head_dim = q.shape
    out = []
    for b in range(batch):
        first = max(0, int(seq_lens[b]) - window) if window else 0
        slots = req_to_token[rows[b], first : seq_lens[b]]
        group = heads // k_cache.shape[1]
        keys = k_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        values = v_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (keys @ q[b].float()[:, :, None])[..., 0] * head_dim**-0.5  # [H, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append((torch.softmax(scores, -1)[:, None] @ values)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype", "atol", "window", "softcap"),
    [
        (9, 3, 64, torch.float32, 1e-5, 0, 0.0),
        (8, 8, 32, torch.float32, 1e-5, 0, 0.0),  # plain multi-head, the generic head size
        (4, 2, 128, torch.float32, 1e-5, 0, 0.0),
        (6, 2, 80, torch.float32, 1e-5, 0, 0.0),
        (4, 2, 64, torch.float32, 1e-5, 33, 20.0),
        # bf16 heads of 64 / 128 take the bf16 dot-product path where the CPU has one: groups of
        # one, three and eight heads (P.V runs four or two heads per pass), windows, soft-capping
        (9, 3, 64, torch.bfloat16, 2e-2, 0, 0.0),
        (16, 2, 64, torch.bfloat16, 2e-2, 0, 0.0),
        (6, 2, 128, torch.bfloat16, 2e-2, 0, 0.0),
        (4, 4, 128, torch.bfloat16, 2e-2, 0, 0.0),
        (6, 2, 80, torch.bfloat16, 2e-2, 0, 0.0),
        (4, 2, 64, torch.bfloat16, 2e-2, 33, 20.0),
    ],
)
def test_kernel_matches_gathered_attention(kernel, heads, kv_heads, head_dim, dtype, atol, window, softcap) -> None:
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    num_slots, max_rows, max_context = 3000, 6, 700
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor([1, 2, 37, 300, 650])
    rows = torch.tensor([4, 0, 2, 5, 1])  # not in batch order
    req_to_token = torch.zeros(max_rows, max_context, dtype=torch.long)
    scattered = torch.randperm(num_slots - 1, generator=g) + 1
    start = 0
    for row, length in zip(rows.tolist(), seq_lens.tolist(), strict=True):
        req_to_token[row, :length] = scattered[start : start + length]
        start += length
    q = torch.randn(len(rows), heads, head_dim, generator=g).to(dtype)

    out = kernel(q, k_cache, v_cache, req_to_token, rows, seq_lens, head_dim**-0.5, window, softcap)

    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, k_cache, v_cache, req_to_token, rows, seq_lens, window, softcap)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    # one key: attention returns that key's value exactly
    torch.testing.assert_close(out[0].float(), v_cache[req_to_token[4, 0]].float().repeat_interleave(heads // kv_heads, 0), atol=atol, rtol=0)


def test_kernel_reads_a_strided_query(kernel) -> None:
    """q arrives as a view split off the fused qkv projection, not a contiguous tensor."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = torch.randn(50, 2, 16, generator=g), torch.randn(50, 2, 16, generator=g)
    req_to_token = torch.arange(1, 41).view(2, 20)
    qk = torch.randn(2, 6, 16, generator=g)  # 4 query heads + 2 key heads, fused
    q = qk[:, :4]
    assert not q.is_contiguous()
    rows, lens = torch.tensor([0, 1]), torch.tensor([20, 11])
    out = kernel(q, k_cache, v_cache, req_to_token, rows, lens, 0.25)
    ref = kernel(q.contiguous(), k_cache, v_cache, req_to_token, rows, lens, 0.25)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, req_to_token, rows, lens), atol=1e-5, rtol=0)


def test_kernel_rejects_mismatched_inputs(kernel) -> None:
    k_cache = v_cache = torch.zeros(10, 2, 16)
    req_to_token = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        kernel(torch.zeros(1, 3, 16), k_cache, v_cache, req_to_token, torch.tensor([0]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(torch.zeros(1, 4, 16, dtype=torch.bfloat16), k_cache, v_cache, req_to_token,
               torch.tensor([0]), torch.tensor([1]), 1.0)
    q = torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        kernel(q, k_cache, v_cache, req_to_token, torch.tensor([2]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        kernel(q, k_cache, v_cache, req_to_token, torch.tensor([0]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        kernel(q, k_cache, v_cache, req_to_token, torch.tensor([0]), torch.tensor([0]), 1.0)


def test_disabled_kernels_fall_back(monkeypatch) -> None:
    import radixgen.kernels as kernels

    monkeypatch.setenv("RADIXGEN_DISABLE_KERNELS", "1")
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.decode_attention_op() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_batch_matches_and_each_request_is_computed_as_alone(kernel, dtype) -> None:
    """From 4 requests per thread on, the bf16 path hands each thread whole requests rather than
    one kv head of one: results must match the reference and, bit for bit, the same requests in
    a batch too small for that."""
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, head_dim = 40, 9, 3, 64
    lengths = torch.randint(1, 200, (batch,), generator=g)
    k_cache = torch.randn(int(lengths.sum()) + 1, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(int(lengths.sum()) + 1, kv_heads, head_dim, generator=g).to(dtype)
    req_to_token = torch.zeros(batch, 200, dtype=torch.long)
    order = torch.randperm(int(lengths.sum()), generator=g) + 1
    start = 0
    for b, length in enumerate(lengths.tolist()):
        req_to_token[b, :length] = order[start : start + length]
        start += length
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    rows = torch.arange(batch)
    out = kernel(q, k_cache, v_cache, req_to_token, rows, lengths, head_dim**-0.5)
    expected = _reference(q, k_cache, v_cache, req_to_token, rows, lengths)
    torch.testing.assert_close(out.float(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    few = kernel(q[:3], k_cache, v_cache, req_to_token, rows[:3], lengths[:3], head_dim**-0.5)
    assert torch.equal(out[:3], few)


def _shared_prefix_ops():
    from radixgen.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or kernels.shared_prefix_attention_for(torch.bfloat16, 64) is None:
        pytest.skip("shared-prefix attention needs the bf16 dot-product kernels (AVX-512 BF16)")
    return kernels


@pytest.mark.parametrize("softcap", [0.0, 25.0])
def test_shared_prefix_then_own_keys_equals_attending_the_whole_row(softcap) -> None:
    """Two groups sharing prefixes of 300 and 70 keys (one group's prefix ending mid-block), a
    row in no group; each row extends its group's prefix with 1-120 keys of its own."""
    kernels = _shared_prefix_ops()
    g = torch.Generator().manual_seed(9)
    heads, kv_heads, head_dim = 9, 3, 64
    k_cache = torch.randn(4000, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(4000, kv_heads, head_dim, generator=g).bfloat16()
    free = iter((torch.randperm(3999, generator=g) + 1).tolist())
    prefixes = {0: [next(free) for _ in range(300)], 1: [next(free) for _ in range(70)]}
    groups = [0, 0, None, 1, 0, 1, 1]  # batch order: groups interleaved
    req_to_token = torch.zeros(len(groups), 500, dtype=torch.long)
    lengths = []
    for b, group in enumerate(groups):
        own = [next(free) for _ in range(int(torch.randint(1, 120, (1,), generator=g)))]
        slots = (prefixes[group] if group is not None else [next(free) for _ in range(200)]) + own
        req_to_token[b, : len(slots)] = torch.tensor(slots)
        lengths.append(len(slots))
    rows, seq_lens = torch.arange(len(groups)), torch.tensor(lengths)
    shared = torch.tensor([len(prefixes[gr]) if gr is not None else 0 for gr in groups])
    leader = torch.tensor([groups.index(gr) if gr is not None else b for b, gr in enumerate(groups)])
    q = torch.randn(len(groups), heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5

    prior = kernels.shared_prefix_attention(q, k_cache, v_cache, req_to_token, rows, shared, leader, scale, softcap)
    out = kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale, 0, softcap, shared, *prior)

    whole = kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale, 0, softcap)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, req_to_token, rows, seq_lens, 0, softcap),
                               atol=2e-2, rtol=0)
    assert torch.equal(out[2], whole[2])  # no group: attended as before
    assert prior[1][2].eq(float("-inf")).all() and prior[2][2].eq(0).all()


def test_shared_prefix_arguments_are_checked() -> None:
    kernels = _shared_prefix_ops()
    k_cache = v_cache = torch.zeros(100, 1, 64, dtype=torch.bfloat16)
    req_to_token = torch.arange(1, 81).view(2, 40)
    q = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    rows, lens = torch.tensor([0, 1]), torch.tensor([40, 40])
    with pytest.raises(RuntimeError, match="does not lead a group"):
        kernels.shared_prefix_attention(q, k_cache, v_cache, req_to_token, rows, torch.tensor([10, 10]),
                                        torch.tensor([1, 0]), 1.0)
    prior = kernels.shared_prefix_attention(q, k_cache, v_cache, req_to_token, rows, torch.tensor([10, 10]),
                                            torch.tensor([0, 0]), 1.0)
    with pytest.raises(RuntimeError, match="leaves no key of its own"):
        kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, lens, 1.0, 0, 0.0, torch.tensor([40, 0]),
                                 *prior)
    with pytest.raises(RuntimeError, match="no window"):
        kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, lens, 1.0, 8, 0.0, torch.tensor([10, 10]),
                                 *prior)


def test_rows_are_grouped_by_the_slots_they_share() -> None:
    import numpy as np

    from radixgen.models.attention.cpu import MIN_SHARED_PREFIX, shared_prefixes

    n = MIN_SHARED_PREFIX
    table = torch.zeros(6, 400, dtype=torch.long)
    common = torch.arange(1000, 1000 + 300)
    table[0, :300] = common  # rows 0, 2, 5 share 300 keys (row 5 only 250 of them, then its own)
    table[2, :300] = common
    table[5, :250] = common[:250]
    table[5, 250:300] = torch.arange(5000, 5050)
    table[1, : n + 10] = torch.arange(2000, 2000 + n + 10)  # rows 1 and 3 share n + 10 keys, then part
    table[3, : n + 10] = table[1, : n + 10]
    table[1, n + 10 : 200] = torch.arange(3000, 3000 + 190 - n)
    table[3, n + 10 : 200] = torch.arange(4000, 4000 + 190 - n)
    table[4, :n] = common[:n]  # row 4 is only n long: its newest key is its own, so it shares n - 1 at most
    rows = np.array([0, 1, 2, 3, 4, 5])
    seq_lens = np.array([301, 200, 301, 200, n, 300])

    shared, leader = shared_prefixes(table, rows, seq_lens)

    assert shared.tolist() == [250, n + 10, 250, n + 10, 0, 250]
    assert leader.tolist() == [0, 1, 0, 1, 4, 0]
    assert shared_prefixes(table, rows[[0, 1]], seq_lens[[0, 1]]) is None  # no two rows share
