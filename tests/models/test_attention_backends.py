"""Every attention backend against the ``torch`` reference on the same pool and plans: decode
(one and several key splits), extend over cached prefixes of different lengths, fresh prefills,
mixed steps, speculative drafts; GQA and MHA, sliding windows, soft-capping, head sizes that are
not powers of two, float32 and bfloat16. The Triton kernels run in Triton's interpreter here
(tests/conftest.py turns it on without a GPU), so the shapes stay small."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from radixgen.kernels import cpu_kernels
from radixgen.models.attention import (
    AttentionBatch,
    LayerAttention,
    create_backend,
    resolve_backend,
)
from radixgen.models.attention.triton_backend import decode_splits


@dataclass
class Pool:
    k: torch.Tensor  # [slots, kv_heads, head_dim]
    v: torch.Tensor
    req_to_token: torch.Tensor  # [rows, context]


def _pool(kv_heads: int, head_dim: int, dtype: torch.dtype, seq_lens: list[int], seed: int,
          device: str = "cpu") -> Pool:
    """A pool whose rows hold scattered, shuffled slots (as a long-running pool's would), with
    every slot written."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    slots = 1 + torch.randperm(total + 37, generator=g)[:total]  # slot 0 is the pad slot
    k = torch.randn(total + 38, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total + 38, kv_heads, head_dim, generator=g).to(dtype)
    req_to_token = torch.zeros(len(seq_lens) + 1, max(seq_lens) + 8, dtype=torch.int64)
    start = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row + 1, :n] = slots[start : start + n]  # row 0 left unused
        start += n
    return Pool(k.to(device), v.to(device), req_to_token.to(device))


def _batch(pool: Pool, prefix: list[int], extend: list[int], *, num_decode: int = 0,
           is_draft: bool = False) -> AttentionBatch:
    rows = np.arange(1, len(prefix) + 1, dtype=np.int64)
    prefix_lens, extend_lens = np.array(prefix, dtype=np.int64), np.array(extend, dtype=np.int64)
    positions = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)])
    table = pool.req_to_token.cpu().numpy()
    out_cache_loc = np.concatenate([table[r, p : p + e] for r, p, e in zip(rows, prefix, extend, strict=True)])
    is_decode = all(e == 1 for e in extend) and not is_draft and not num_decode
    return AttentionBatch(rows, prefix_lens, extend_lens, positions, out_cache_loc, is_decode=is_decode,
                          num_decode=num_decode, is_draft=is_draft)


def _run(name: str, pool: Pool, batch: AttentionBatch, heads: int, layer: LayerAttention, seed: int) -> torch.Tensor:
    """The backend's output for random queries, with the new tokens' K/V handed to it to write."""
    g = torch.Generator().manual_seed(seed)
    dtype, head_dim = pool.k.dtype, pool.k.shape[-1]
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=g).to(pool.k.device, dtype)
    slots = torch.from_numpy(batch.out_cache_loc).to(pool.k.device)
    k_cache, v_cache = pool.k.clone(), pool.v.clone()
    new_k, new_v = k_cache[slots].clone(), v_cache[slots].clone()
    k_cache[slots], v_cache[slots] = float("nan"), float("nan")  # must be written by the backend
    kernels = cpu_kernels() if name == "cpu" else None
    backend = create_backend(name, req_to_token=pool.req_to_token, dtype=dtype, head_dim=head_dim, kernels=kernels)
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, layer, backend.prepare(batch))
    assert torch.equal(k_cache[slots], new_k) and torch.equal(v_cache[slots], new_v)
    return out.float().cpu()


# (heads, kv_heads, head_dim): GQA with SmolLM2's group of 3, MHA, and head sizes that are not
# powers of two
SHAPES = [(6, 2, 32), (4, 4, 16), (4, 1, 40)]
LAYERS = {
    "plain": LayerAttention(scale=0.3),
    "window": LayerAttention(scale=0.3, window=7),
    "softcap": LayerAttention(scale=0.3, softcap=2.0),
    "window+softcap": LayerAttention(scale=0.3, window=20, softcap=5.0),
}
# (atol, rtol): bf16 outputs are rounded to 8 bits of mantissa, one step of which is 1.6e-2 of
# an output near 2
TOLERANCE = {torch.float32: (2e-5, 0.0), torch.bfloat16: (2e-2, 1.6e-2)}
# prefix, extend per request; mixed steps give their decode rows' count
CASES = {
    "decode": ([5, 70, 33], [1, 1, 1], 0, False),
    "decode-long": ([600], [1], 0, False),  # several key splits merged
    "prefill": ([0, 0], [19, 40], 0, False),
    "extend": ([3, 50, 0], [17, 5, 9], 0, False),  # over cached prefixes of different lengths
    "mixed": ([20, 0, 30, 12], [9, 21, 1, 1], 2, False),
    "draft": ([10, 40], [4, 1], 1, True),
}


def check_triton_against_reference(case: str, shape: tuple[int, int, int], layer: str, dtype: torch.dtype,
                                   device: str = "cpu") -> None:
    heads, kv_heads, head_dim = shape
    prefix, extend, num_decode, is_draft = CASES[case]
    pool = _pool(kv_heads, head_dim, dtype, [p + e for p, e in zip(prefix, extend, strict=True)], seed=len(prefix),
                 device=device)
    batch = _batch(pool, prefix, extend, num_decode=num_decode, is_draft=is_draft)
    want = _run("torch", pool, batch, heads, LAYERS[layer], seed=1)
    got = _run("triton", pool, batch, heads, LAYERS[layer], seed=1)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert want.abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer", list(LAYERS), ids=list(LAYERS))
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa", "mha", "odd"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_the_reference(case: str, shape: tuple[int, int, int], layer: str, dtype: torch.dtype) -> None:
    if case == "decode-long" and (layer != "plain" or shape != SHAPES[0]):
        pytest.skip("the long case once is enough: the interpreter is slow")
    check_triton_against_reference(case, shape, layer, dtype)


def test_the_long_decode_case_uses_several_splits() -> None:
    assert decode_splits(601, 1) > 1
    assert decode_splits(601, 256) == 1, "a full batch fills the device without splitting keys"
    assert decode_splits(100, 1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer", list(LAYERS), ids=list(LAYERS))
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_backend_matches_the_reference(case: str, layer: str, dtype: torch.dtype) -> None:
    """The cpu backend with whatever native kernels this machine builds (its SDPA paths
    without): SmolLM2's head layout."""
    prefix, extend, num_decode, is_draft = CASES[case]
    pool = _pool(3, 64, dtype, [p + e for p, e in zip(prefix, extend, strict=True)], seed=2)
    batch = _batch(pool, prefix, extend, num_decode=num_decode, is_draft=is_draft)
    want = _run("torch", pool, batch, 9, LAYERS[layer], seed=3)
    got = _run("cpu", pool, batch, 9, LAYERS[layer], seed=3)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_backend_names_resolve_by_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu) == "cpu"
    assert resolve_backend("auto", cuda) == "triton"
    assert resolve_backend("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_backend("cpu", cuda)
    with pytest.raises(ValueError, match=r"one of auto, cpu, torch, triton; got 'sdpa'"):
        resolve_backend("sdpa", cpu)
