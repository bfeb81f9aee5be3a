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
