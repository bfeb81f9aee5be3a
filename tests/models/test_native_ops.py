"""The fused layer ops (``torch.ops.radixgen``, defined in radixgen/kernels/ops.py): their C++
kernels and their Triton kernels (interpreted here) against their PyTorch definitions.

Each kernel must give what the definition gives: in float32 to rounding (sums run in another
order), in bfloat16 the same values up to one unit in the last place where a reduction feeds a
rounding. Inputs are odd sizes too, so vector-loop tails run. ``kernels`` (the fixture) loads
the extension, after which CPU tensors dispatch to the C++ kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixgen.kernels import reference
from radixgen.models.config import RopeSpec
from radixgen.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
BF16_ULP = 2.0**-7  # relative spacing of bfloat16 values


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6, ulps: float = 1) -> None:
    """``atol``: for sums of many terms, whose order moves the last float32 bits of a result
    that cancels to near zero (dot products of N(0,1) rows: 2e-4 at lengths up to 1536).
    ``ulps``: bfloat16 units in the last place allowed."""
    if actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=ulps * BF16_ULP, atol=atol)
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
    out = torch.ops.radixgen.small_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (tokens, out_features)
    _close(out, expected.to(dtype), atol=2e-4)


def test_small_linear_rejects_mismatched_shapes(kernels) -> None:
    with pytest.raises(RuntimeError, match="x \\[T, in\\] and weight \\[out, in\\]"):
        torch.ops.radixgen.small_linear(torch.zeros(1, 8), torch.zeros(4, 9), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.radixgen.small_linear(torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_switches_kernels_by_token_count(kernels, dtype, monkeypatch) -> None:
    """Up to small_linear_max_tokens rows take the plain weight, more take oneDNN's packed one;
    both give the layer's product, and without the plain copy the packed path serves all."""
    layer = Linear(64, 48, True, dtype)
    layer.small_linear_max_tokens = 2
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    plain_w, plain_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    calls: list[int] = []
    native = torch.ops.radixgen.small_linear.default

    def counted(x, w, b):
        calls.append(x.shape[0])
        return native(x, w, b)

    monkeypatch.setattr(torch.ops.radixgen.small_linear, "default", counted)
    for tokens in (1, 2, 3, 9):
        x = torch.randn(tokens, 64).to(dtype)
        _close(layer(x), F.linear(x.float(), plain_w.float(), plain_b.float()).to(dtype), atol=2e-4)
    assert calls == [1, 2]
    layer.pack(keep_plain=False)
    if layer._packed is None:  # no oneDNN layout for this dtype on this CPU (bf16 without AVX-512)
        assert layer.weight.numel() == 64 * 48, "the plain weight is the only copy: it must stay"
        return
    assert layer.weight.numel() == 0
    x = torch.randn(1, 64).to(dtype)
    _close(layer(x), F.linear(x.float(), plain_w.float(), plain_b.float()).to(dtype), atol=2e-4)
    assert calls == [1, 2]


def _check_norms(rms_norm, add_rms_norm, dtype, tokens, multiply_in_float) -> None:
    norm = RMSNorm(200, 1e-5, dtype, multiply_in_float)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(tokens, 200) * 3).to(dtype)
    residual = torch.randn(tokens, 200).to(dtype)
    x[0] = 0  # a zero row: eps keeps it finite
    _close(rms_norm(x, norm.weight, norm.eps, multiply_in_float), reference.rms_norm(x, norm.weight, norm.eps, multiply_in_float))

    expected_residual = residual.clone()
    expected_normed = reference.add_rms_norm(x, expected_residual, norm.weight, norm.eps, multiply_in_float)
    in_place = residual.clone()
    normed = add_rms_norm(x, in_place, norm.weight, norm.eps, multiply_in_float)
    torch.testing.assert_close(in_place, expected_residual, rtol=0, atol=0)  # one rounding, same place
    _close(normed, expected_normed)
    assert torch.isfinite(normed).all()


@pytest.mark.parametrize("multiply_in_float", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rms_norm_and_fused_residual_add(kernels, dtype, tokens, multiply_in_float) -> None:
    _check_norms(torch.ops.radixgen.rms_norm, torch.ops.radixgen.add_rms_norm, dtype, tokens, multiply_in_float)
    norm = RMSNorm(200, 1e-5, dtype)
    residual = torch.randn(tokens, 200).to(dtype)
    _, returned = norm.add_and_norm(torch.randn(tokens, 200).to(dtype), residual)
    assert returned is residual, "the layer hands back the residual it updated in place"


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

    q = torch.ops.radixgen.rope_store_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads)

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
        torch.ops.radixgen.rope_store_kv(qkv, torch.tensor([0, 1]), rope.cos, rope.sin, k_cache, v_cache,
                                         torch.tensor([1, 4]), 2)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        torch.ops.radixgen.rope_store_kv(qkv, torch.tensor([0, 8]), rope.cos, rope.sin, k_cache, v_cache,
                                         torch.tensor([1, 2]), 2)
    assert (k_cache == 0).all() and (v_cache == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_silu_mul_matches_swiglu_activation(kernels, dtype, tokens) -> None:
    gate_up = (torch.randn(tokens, 2 * 150) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0]).to(dtype)  # far tails of exp
    gate, up = gate_up.split(150, dim=-1)
    out = torch.ops.radixgen.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    _close(out, F.silu(gate) * up)
    _close(reference.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_native_path_matches_its_definition(kernels, dtype) -> None:
    mlp = GatedMLP(64, 96, False, dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for module in (mlp.gate_up, mlp.down):
        module.pack()
    for tokens in (1, 2, 17):
        x = torch.randn(tokens, 64).to(dtype)
        expected = F.linear(reference.silu_mul(F.linear(x, mlp.gate_up.weight)), mlp.down.weight)
        _close(mlp(x), expected, atol=2e-4)


# The Triton kernels (CUDA's implementations), in Triton's interpreter on CPU tensors. The
# interpreter rounds float32 to bfloat16 toward zero where a GPU rounds to nearest even (checked
# on triton 3.9), so bfloat16 results may be one more unit off here than on a GPU.
INTERPRETED_ULPS = 2


def _close_interpreted(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 as tightly as the C++ kernels; bfloat16 within two units relative, or one unit of
    the largest value (a sum that cancels keeps the error of its larger terms)."""
    if actual.dtype == torch.bfloat16:
        _close(actual, expected, atol=BF16_ULP * float(expected.abs().max()), ulps=INTERPRETED_ULPS)
    else:
        _close(actual, expected)

@pytest.mark.parametrize("multiply_in_float", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_triton_norms_match_their_definition(dtype, tokens, multiply_in_float) -> None:
    from radixgen.kernels import triton_ops

    norm = RMSNorm(200, 1e-5, dtype, multiply_in_float)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(tokens, 200) * 3).to(dtype)
    x[0] = 0  # a zero row: eps keeps it finite
    _close_interpreted(triton_ops.rms_norm(x, norm.weight, norm.eps, multiply_in_float),
                       reference.rms_norm(x, norm.weight, norm.eps, multiply_in_float))
    residual = torch.randn(tokens, 200).to(dtype)
    got_residual, want_residual = residual.clone(), residual.clone()
    got = triton_ops.add_rms_norm(x, got_residual, norm.weight, norm.eps, multiply_in_float)
    want = reference.add_rms_norm(x, want_residual, norm.weight, norm.eps, multiply_in_float)
    _close_interpreted(got_residual, want_residual)
    _close_interpreted(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_mul_matches_its_definition(dtype) -> None:
    from radixgen.kernels import triton_ops

    gate_up = (torch.randn(3, 2 * 150) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0]).to(dtype)
    _close_interpreted(triton_ops.silu_mul(gate_up), reference.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 80)])
def test_triton_rope_store_kv_matches_its_definition(dtype, heads, kv_heads, head_dim) -> None:
    from radixgen.kernels import triton_ops

    rope = RotaryEmbedding(head_dim, 512, _rope_spec(head_dim, attention_factor=1.2), dtype)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions, slots = torch.tensor([0, 1, 300, 511, 7]), torch.tensor([9, 3, 30, 17, 22])
    got_k, got_v = torch.zeros(32, kv_heads, head_dim, dtype=dtype), torch.zeros(32, kv_heads, head_dim, dtype=dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    q = triton_ops.rope_store_kv(qkv, positions, rope.cos, rope.sin, got_k, got_v, slots, heads)
    expected_q = reference.rope_store_kv(qkv, positions, rope.cos, rope.sin, want_k, want_v, slots, heads)
    _close_interpreted(q, expected_q)
    _close_interpreted(got_k, want_k)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)


def test_a_model_on_the_op_definitions_alone_matches_transformers() -> None:
    """Without the extension (RADIXGEN_DISABLE_KERNELS=1, in a fresh process) every fused op
    runs its PyTorch definition: the transformers-reference tests of the tiny models pass there too."""
    env = {**os.environ, "RADIXGEN_DISABLE_KERNELS": "1"}
    root = Path(__file__).resolve().parents[2]
    probe = ("import torch; from radixgen.kernels import cpu_kernels; assert cpu_kernels() is None; "
             "assert not torch._C._dispatch_has_kernel_for_dispatch_key('radixgen::rms_norm', 'CPU')")
    subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, check=True, timeout=120)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "tests/models/test_llama_reference.py", "-k", "tiny and (sdpa or reference) and not padded"],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


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


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_argmax_rows_takes_the_first_largest_and_a_nan_as_largest_like_torch(kernels, vocab) -> None:
    """Ties in one vector lane and across lanes, all -inf, NaNs at the start, in the middle and in
    the tail that the vector loop does not cover, a strided input."""
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    last = vocab - 1
    logits[0, min(5, last)] = logits[0, last] = 50.0
    logits[1] = float("-inf")
    logits[2, min(37, last)] = logits[2, min(3, last)] = float("nan")
    logits[3, last] = float("nan")
    logits[4, 0] = float("nan")
    logits[5, min(16, last)] = logits[5, min(32, last)] = 1e9
    logits[6, min(17, last)] = logits[6, min(16, last)] = 1e9
    logits[7, max(0, last - 1)] = 1e9
    got = torch.ops.radixgen.argmax_rows(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    strided = torch.randn(4, 2 * vocab)[:, ::2]
    assert torch.equal(torch.ops.radixgen.argmax_rows(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize(("vocab", "width"), [(1, 1), (31, 1), (100, 4), (49152, 1536), (49155, 1540)])
def test_apply_bitmask_kernel_matches_the_reference(kernels, vocab, width) -> None:
    """Words that allow every token (skipped) and none (filled whole), mixed words with bit 31,
    a last word past the vocabulary, and a bitmask wider than the vocabulary."""
    gen = torch.Generator().manual_seed(vocab)
    words = torch.randint(-(2**31), 2**31 - 1, (6, width), dtype=torch.int32, generator=gen)
    words[0] = -1
    words[1] = 0
    words[2, ::2] = -1
    words[3, 1::2] = 0
    words[4, -1] = -(2**31)  # only bit 31 of the last word
    logits = torch.randn(6, vocab, generator=gen)
    native, expected = logits.clone(), logits.clone()
    torch.ops.radixgen.apply_bitmask(native, words)
    reference.apply_bitmask(expected, words)
    assert torch.equal(native, expected)
    assert torch.equal(native[0], logits[0]) and bool(torch.isinf(native[1]).all())


def test_a_built_library_is_loaded_without_the_builder(kernels: object) -> None:
    """A start that finds the library built for these sources and flags loads it as it is: the
    builder (torch's cpp_extension and ninja, about a fifth of a second) is not imported."""
    code = ("import sys, torch; from radixgen.kernels import cpu_kernels; ops = cpu_kernels(); "
            "x = torch.randn(3, 64); w = torch.ones(64); "
            "assert torch.allclose(torch.ops.radixgen.rms_norm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5); "
            "print(ops is not None, 'torch.utils.cpp_extension' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.split() == ["True", "False"], result.stderr
