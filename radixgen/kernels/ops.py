"""A layer's fused steps as PyTorch operators, so the model has one forward on every device.

``torch.ops.radixgen.{rms_norm, add_rms_norm, rope_store_kv, silu_mul, small_linear,
quant_linear, argmax_rows, apply_bitmask}`` are defined here. Each has three implementations, picked by PyTorch's dispatcher
from the tensors' device: the C++ kernel for CPU (``fused_ops.cpp`` and the others register it
when the extension loads), a Triton kernel for CUDA (``triton_ops.py``; ``small_linear`` and
``quant_linear`` run the PyTorch code there), and the PyTorch code (``reference.py``) as the fallback for
every other case (``CompositeExplicitAutograd``: a CPU without a compiler, any other device).
Fake implementations give shapes without computing, for ``torch.compile`` and CUDA graphs.

The PyTorch code is each op's definition: the native kernels round where it rounds (in reduced
precision each intermediate it materialises is rounded to the model's dtype at the same place),
and the tests hold each kernel to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from radixgen.kernels import reference
from radixgen.kernels.reference import REFERENCE

_lib = torch.library.Library("radixgen", "FRAGMENT")

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps, bool multiply_in_float=False) -> Tensor",
    "add_rms_norm": ("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
                     "bool multiply_in_float=False) -> Tensor"),
    "rope_store_kv": ("rope_store_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
                      "Tensor(b!) v_cache, Tensor out_cache_loc, int num_heads) -> Tensor"),
    "silu_mul": "silu_mul(Tensor gate_up) -> Tensor",
    "small_linear": "small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "quant_linear": "quant_linear(Tensor x, Tensor packed, int out_features, int kind) -> Tensor",
    "argmax_rows": "argmax_rows(Tensor logits) -> Tensor",
    "apply_bitmask": "apply_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()",
}


def _fake_rows(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


def _fake_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor, num_heads: int) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[2])


def _fake_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def _fake_small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_quant_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, kind: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _fake_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _fake_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    return None


_FAKES: dict[str, Callable[..., torch.Tensor | None]] = {"rms_norm": _fake_rows, "add_rms_norm": _fake_rows, "rope_store_kv": _fake_rope,
          "silu_mul": _fake_silu_mul, "small_linear": _fake_small_linear, "quant_linear": _fake_quant_linear,
          "argmax_rows": _fake_argmax_rows, "apply_bitmask": _fake_apply_bitmask}


def _cuda(name: str) -> Any:
    def run(*args: Any) -> torch.Tensor:
        # imported on first use: triton is heavy, and needed on CUDA only
        from radixgen.kernels import triton_ops

        return getattr(triton_ops, name)(*args)

    return run


_TRITON_OPS = ("rms_norm", "add_rms_norm", "rope_store_kv", "silu_mul")

for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, REFERENCE[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"radixgen::{_name}", _FAKES[_name], lib=_lib)
    if _name in _TRITON_OPS:
        _lib.impl(_name, _cuda(_name), "CUDA")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits [B, V] whose bit is clear in ``bitmask`` [B, W] (int32 words, bit i of word
    j for token 32*j + i; on the logits' device) to -inf, in place: the native kernel for
    contiguous float32 CPU logits, the PyTorch code otherwise."""
    if logits.dtype == torch.float32 and logits.is_contiguous():
        torch.ops.radixgen.apply_bitmask.default(logits, bitmask)
    else:
        reference.apply_bitmask(logits, bitmask)
