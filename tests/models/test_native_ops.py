"""The fused CPU ops and the small-batch linear against the PyTorch code they replace.

Each native op must give what the eager path in radixgen/models/layers.py gives: in float32 to
rounding (sums run in another order), in bfloat16 the same values up to one unit in the last
place where a reduction feeds a rounding. Inputs are odd sizes too, so vector-loop tails run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from radixgen.models.config import RopeSpec
from radixgen.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
BF16_ULP = 2.0**-7  # relative spacing of bfloat16 values


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    """``atol``: for sums of many terms, whose order moves the last float32 bits of a result
    that cancels to near zero (dot products of N(0,1) rows: 2e-4 at lengths up to 1536)."""
    if actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=BF16_ULP, atol=atol)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "in_features", "out_features"), [(1, 576, 960), (2, 100, 37), (3, 1536, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_linear(kernels, dtype, tokens, in_features, out_features, bias) -> None:
    g = torch.Generator().manual_seed(tokens * in_features)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())  # float32 accumulation
    out = kernels.small_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (tokens, out_features)
    _close(out, expected.to(dtype), atol=2e-4)


def test_small_linear_rejects_mismatched_shapes(kernels) -> None:
    with pytest.raises(RuntimeError, match="x \\[T, in\\] and weight \\[out, in\\]"):
        kernels.small_linear(torch.zeros(1, 8), torch.zeros(4, 9), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernels.small_linear(torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_switches_kernels_by_token_count(kernels, dtype) -> None:
    """Up to small_linear_max_tokens rows take the plain weight, more take oneDNN's packed one;
    both give the layer's product, and without the plain copy the packed path serves all."""
    layer = Linear(64, 48, True, dtype)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    plain_w, plain_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    calls: list[int] = []

    def counted(x, w, b):
        calls.append(x.shape[0])
        return kernels.small_linear(x, w, b)

    spied = dataclasses.replace(kernels, small_linear=counted)
    for tokens in (1, 2, 3, 9):
        x = torch.randn(tokens, 64).to(dtype)
        _close(layer(x, spied), F.linear(x.float(), plain_w.float(), plain_b.float()).to(dtype), atol=2e-4)
    assert calls == [1, 2]
    layer.pack(keep_plain=False)
    if layer._packed is None:  # no oneDNN layout for this dtype on this CPU (bf16 without AVX-512)
        assert layer.weight.numel() == 64 * 48, "the plain weight is the only copy: it must stay"
        return
    assert layer.weight.numel() == 0
    x = torch.randn(1, 64).to(dtype)
    _close(layer(x, spied), F.linear(x.float(), plain_w.float(), plain_b.float()).to(dtype), atol=2e-4)
    assert calls == [1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rms_norm_and_fused_residual_add(kernels, dtype, tokens) -> None:
    norm = RMSNorm(200, 1e-5, dtype)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(tokens, 200) * 3).to(dtype)
    residual = torch.randn(tokens, 200).to(dtype)
    x[0] = 0  # a zero row: eps keeps it finite
    _close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))

    expected_normed, expected_residual = norm.add_and_norm(x, residual)  # the eager path
    in_place = residual.clone()
    normed, returned = norm.add_and_norm(x, in_place, kernels)
    assert returned is in_place
    torch.testing.assert_close(in_place, expected_residual, rtol=0, atol=0)  # one rounding, same place
    _close(normed, expected_normed)
    assert torch.isfinite(normed).all()


def _rope_spec(head_dim: int, attention_factor: float = 1.0) -> RopeSpec:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return RopeSpec(tuple(inv_freq.tolist()), attention_factor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 80)])
def test_rope_store_kv_matches_rotate_and_pool_write(kernels, dtype, heads, kv_heads, head_dim) -> None:
    rope = RotaryEmbedding(head_dim, 512, _rope_spec(head_dim, attention_factor=1.2), dtype)
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 100, 511, 37, 5])
    slots = torch.tensor([9, 3, 30, 0, 17, 22, 11])
    k_cache = torch.zeros(32, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    q = kernels.rope_store_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads)

    cos, sin = rope.tables(positions)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    expected_q, expected_k = rope.rotate(qk, cos, sin).split([heads, kv_heads], dim=1)
    _close(q, expected_q)
    _close(k_cache[slots], expected_k)
    torch.testing.assert_close(v_cache[slots], qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert (k_cache[untouched] == 0).all() and (v_cache[untouched] == 0).all()


def test_rope_store_kv_rejects_bad_slots_and_positions_before_writing(kernels) -> None:
    rope = RotaryEmbedding(16, 8, _rope_spec(16), torch.float32)
    qkv = torch.ones(2, 4 * 16)
    k_cache, v_cache = torch.zeros(4, 1, 16), torch.zeros(4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.rope_store_kv(qkv, torch.tensor([0, 1]), rope.cos, rope.sin, k_cache, v_cache, torch.tensor([1, 4]), 2)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.rope_store_kv(qkv, torch.tensor([0, 8]), rope.cos, rope.sin, k_cache, v_cache, torch.tensor([1, 2]), 2)
    assert (k_cache == 0).all() and (v_cache == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_silu_mul_matches_swiglu_activation(kernels, dtype, tokens) -> None:
    gate_up = (torch.randn(tokens, 2 * 150) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0]).to(dtype)  # far tails of exp
    gate, up = gate_up.split(150, dim=-1)
    out = kernels.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    _close(out, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_native_path_matches_eager(kernels, dtype) -> None:
    mlp = GatedMLP(64, 96, False, dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for module in (mlp.gate_up, mlp.down):
        module.pack()
    for tokens in (1, 2, 17):
        x = torch.randn(tokens, 64).to(dtype)
        _close(mlp(x, kernels), mlp(x), atol=2e-4)


def test_engine_without_the_small_batch_path_frees_plain_weights_and_agrees(make_engine, kernels) -> None:
    """small_linear_max_tokens=0 drops the plain weight copies (the tied head keeps sharing the
    embedding) and batch-1 greedy decoding gives the same tokens as the default path."""
    from radixgen import SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    default, without = make_engine(), make_engine(small_linear_max_tokens=0)
    model = without.runner.model
    assert all(layer.attn.qkv.weight.numel() == 0 for layer in model.decoder_layers())
    assert model.lm_head.weight is model.embed
    assert default.runner.model.decoder_layers()[0].attn.qkv.weight.numel() > 0
    prompt = "The radix tree"
    assert default.generate([prompt], params)[0].token_ids == without.generate([prompt], params)[0].token_ids
