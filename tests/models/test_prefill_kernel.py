"""The native CPU prefill-attention kernel against float32 attention over the same pool rows.

The kernel reads K/V through req_to_token and walks blocks of 16 queries over blocks of 64
keys, skipping what causality or a window hides; the cases cover what that changes: slots
scattered over the pool, requests extending a cached prefix or starting fresh, lengths on and
off the block edges (down to one token), GQA groups and plain multi-head, head sizes with and
without the 16-lane loops, sliding windows shorter than a block and soft-capping. On machines
without AVX-512 BF16 the same blocks run through plain loops, and the same tests hold them.
Each test runs on bfloat16 pools and on float32 ones (the kernel's AVX2 path: its own blocking
of every query head of a kv head together, its tiles' row and dimension tails, its masked
softmax), the latter skipped where the build has no AVX2.
"""

from __future__ import annotations

import pytest
import torch

from radixgen.kernels import cpu_kernels

# bf16 inputs are exact in float32; the bf16 path rounds the softmax weights and the output to
# bf16 (outputs here are O(1): one bf16 step is 2^-8 relative). The float32 path only sums in
# another order than the reference.
ATOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def kernels():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    return kernels


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def dtype(request, kernels):
    if request.param == torch.float32 and not kernels.prefill_attention_native(torch.float32):
        pytest.skip("the float32 prefill path needs a build with AVX2 and FMA")
    return request.param


@pytest.fixture
def kernel(kernels, dtype):
    return kernels.prefill_attention


def _pool(kv_heads, head_dim, prefix_lens, extend_lens, rows, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(prefix_lens) + sum(extend_lens) + 200
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    req_to_token = torch.zeros(max(rows) + 2, max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)) + 5,
                               dtype=torch.long)
    scattered = torch.randperm(num_slots - 1, generator=g) + 1
    start = 0
    for row, p, e in zip(rows, prefix_lens, extend_lens, strict=True):
        req_to_token[row, : p + e] = scattered[start : start + p + e]
        start += p + e
    return k_cache, v_cache, req_to_token, g


def _reference(q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, scale, window=0, softcap=0.0):
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    outs, start = [], 0
    for row, p, e in zip(rows, prefix_lens, extend_lens, strict=True):
        slots = req_to_token[row, : p + e]
        keys = k_cache[slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, L, D]
        values = v_cache[slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        scores = q[start : start + e].float().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [H, E, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos, query_pos = torch.arange(p + e)[None, :], p + torch.arange(e)[:, None]
        visible = key_pos <= query_pos
        if window:
            visible &= key_pos > query_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        outs.append((probs @ values).transpose(0, 1))
        start += e
    return torch.cat(outs)


def _run(kernel, q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, scale, window=0, softcap=0.0):
    return kernel(q, k_cache, v_cache, req_to_token, torch.tensor(rows), torch.tensor(prefix_lens),
                  torch.tensor(extend_lens), scale, window, softcap)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "softcap"),
    [
        (9, 3, 64, 0, 0.0),  # SmolLM2's shape
        (4, 4, 32, 0, 0.0),  # plain multi-head
        (4, 2, 128, 0, 0.0),
        (6, 2, 80, 0, 0.0),  # 64 + 16 lanes
        (2, 1, 40, 0, 0.0),  # no 16-lane loop
        (4, 2, 64, 37, 0.0),  # a window shorter than a key block
        (4, 2, 64, 200, 0.0),
        (4, 2, 64, 0, 30.0),
        (4, 2, 64, 50, 20.0),  # Gemma 2: both
    ],
)
def test_kernel_matches_masked_attention(kernel, dtype, heads, kv_heads, head_dim, window, softcap) -> None:
    # fresh prompts and extends of a cached prefix, lengths on and off the 16 / 64 block edges
    prefix_lens = [0, 37, 0, 100, 64, 0, 5]
    extend_lens = [1, 70, 129, 300, 64, 17, 15]
    rows = [5, 0, 3, 1, 2, 6, 4]  # not in batch order
    k_cache, v_cache, req_to_token, g = _pool(kv_heads, head_dim, prefix_lens, extend_lens, rows, heads + head_dim,
                                              dtype)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5

    out = _run(kernel, q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, scale, window, softcap)

    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, scale, window, softcap)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)
    # the first token of a fresh prompt sees only itself: its value, exactly
    first_value = v_cache[req_to_token[rows[0], 0]].repeat_interleave(heads // kv_heads, 0)
    assert torch.equal(out[0], first_value)


def test_a_requests_result_does_not_depend_on_the_requests_beside_it(kernel, dtype) -> None:
    """Bit for bit: the greedy answer of a prompt must not change with the batch it prefills in."""
    prefix_lens, extend_lens, rows = [0, 30, 0], [90, 50, 200], [0, 1, 2]
    k_cache, v_cache, req_to_token, g = _pool(3, 64, prefix_lens, extend_lens, rows, 11, dtype)
    q = torch.randn(sum(extend_lens), 9, 64, generator=g).to(dtype)
    together = _run(kernel, q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, 0.125)
    alone = _run(kernel, q[90:140], k_cache, v_cache, req_to_token, [1], [30], [50], 0.125)
    assert torch.equal(together[90:140], alone)


def test_kernel_reads_a_strided_query(kernel, dtype) -> None:
    """q arrives as a view split off the fused qkv projection, not a contiguous tensor."""
    prefix_lens, extend_lens, rows = [3], [40], [0]
    k_cache, v_cache, req_to_token, g = _pool(2, 32, prefix_lens, extend_lens, rows, 5, dtype)
    qk = torch.randn(40, 6, 32, generator=g).to(dtype)  # 4 query heads + 2 key heads, fused
    q = qk[:, :4]
    assert not q.is_contiguous()
    out = _run(kernel, q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, 0.2)
    assert torch.equal(out, _run(kernel, q.contiguous(), k_cache, v_cache, req_to_token, rows, prefix_lens,
                                 extend_lens, 0.2))


def test_kernel_refuses_lengths_outside_the_row_table(kernel, dtype) -> None:
    k_cache, v_cache, req_to_token, _ = _pool(1, 16, [0], [10], [0], 1, dtype)
    q = torch.zeros(10, 2, 16, dtype=dtype)
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        _run(kernel, q, k_cache, v_cache, req_to_token, [0], [req_to_token.shape[1]], [10], 0.25)
    with pytest.raises(RuntimeError, match="extend_lens sum"):
        _run(kernel, q, k_cache, v_cache, req_to_token, [0], [0], [9], 0.25)


def test_kernel_refuses_mixed_or_other_dtypes(kernels) -> None:
    k_cache, v_cache, req_to_token, _ = _pool(1, 16, [0], [10], [0], 1, torch.float32)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        _run(kernels.prefill_attention, torch.zeros(10, 2, 16, dtype=torch.bfloat16), k_cache, v_cache, req_to_token,
             [0], [0], [10], 0.25)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        _run(kernels.prefill_attention, torch.zeros(10, 2, 16, dtype=torch.float16), k_cache.half(), v_cache.half(),
             req_to_token, [0], [0], [10], 0.25)


def test_a_prefill_step_larger_than_the_kept_pack_buffer_matches_too(kernel, dtype) -> None:
    """Both kernels keep their packing buffers between calls up to a bound (32 MiB), and pack a
    larger step into a buffer of its own; that path must give the same attention."""
    heads, kv_heads, head_dim = 2, 1, 128
    # keys x 128 dims x K and V past 32 MiB: 33k in float32, 66k in the bf16 kernel's word pairs
    prefix_lens, extend_lens, rows = [33_000 if dtype == torch.float32 else 66_000], [20], [0]
    k_cache, v_cache, req_to_token, g = _pool(kv_heads, head_dim, prefix_lens, extend_lens, rows, 3, dtype)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=g).to(dtype)
    out = _run(kernel, q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, head_dim**-0.5)
    expected = _reference(q, k_cache, v_cache, req_to_token, rows, prefix_lens, extend_lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)
