"""HF checkpoint tensor names -> the decoder's parameters, for every family.

Linears are fused where the decoder fuses them (q/k/v, gate/up) unless the checkpoint already
stores them fused (Phi-3). Gemma's norms scale by (1 + weight): the 1 is folded into the weight
here, so every norm runs the same op. Expert weights are read in transformers 5's stacked
layout or the per-expert layout of hub checkpoints (``experts.{j}.gate_proj`` and Mixtral's
``block_sparse_moe.experts.{j}.w1/w2/w3``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixgen.host_memory import WeightArena
from radixgen.models.gguf_weights import GGUFTensor
from radixgen.models.layers import Linear
from radixgen.models.moe import SparseMoE
from radixgen.models.quantized import (
    PackedWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    cat_rows,
    quantize,
)

if TYPE_CHECKING:
    from radixgen.models.decoder import CausalLM, DecoderLayer

# (our norm, the checkpoint's name) per norm layout
_NORM_NAMES = {
    "pre": (("attn_in_norm", "input_layernorm"), ("mlp_in_norm", "post_attention_layernorm")),
    "sandwich": (("attn_in_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
                 ("mlp_in_norm", "pre_feedforward_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm")),
    "post": (("attn_out_norm", "post_attention_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm")),
}


class _Tensors:
    def __init__(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.state, self.dtype = state, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        return self.state[name].to(self.dtype)


@torch.no_grad()
def load_into(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """Copy an HF-named state dict in: fuse q/k/v and gate/up (unless the checkpoint stores them
    fused), fold a norm offset into the norm weights, stack experts; then pack each linear for
    its kernel and tie the head to the embedding where the model does."""
    _copy_weights(model, state)
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed  # the plain head the small-batch path reads: no second copy


def _copy_weights(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    cfg = model.config
    family = cfg.family
    take = _Tensors(state, model.embed.dtype)
    offset = family.norm_offset
    model.embed.copy_(take("model.embed_tokens.weight"))
    head = state.get("lm_head.weight") if not cfg.tie_word_embeddings else None
    model.lm_head.weight.copy_(head.to(model.embed.dtype) if head is not None else model.embed)
    model.norm.weight.copy_(take("model.norm.weight") + offset)
    for i, layer in enumerate(model.decoder_layers()):
        p = f"model.layers.{i}."
        _load_attention(layer, take, p + "self_attn.", family.fused_checkpoint, offset)
        for ours, theirs in _NORM_NAMES[family.norm_layout]:
            norm = getattr(layer, ours)
            norm.weight.copy_(take(p + theirs + ".weight") + offset)
        if isinstance(layer.mlp, SparseMoE):
            _load_experts(layer.mlp, take, p, cfg.moe.num_experts if cfg.moe else 0)
        else:
            _load_mlp(layer, take, p + "mlp.", family.fused_checkpoint)


def _load_attention(layer: DecoderLayer, take: _Tensors, p: str, fused: bool, offset: float) -> None:
    attn = layer.attn
    if fused:
        attn.qkv.weight.copy_(take(p + "qkv_proj.weight"))
    else:
        attn.qkv.weight.copy_(torch.cat([take(p + f"{n}_proj.weight") for n in "qkv"]))
    if attn.qkv.bias is not None:
        attn.qkv.bias.copy_(take(p + "qkv_proj.bias") if fused else torch.cat([take(p + f"{n}_proj.bias") for n in "qkv"]))
    attn.o.weight.copy_(take(p + "o_proj.weight"))
    if attn.q_norm is not None and attn.k_norm is not None:
        attn.q_norm.weight.copy_(take(p + "q_norm.weight") + offset)
        attn.k_norm.weight.copy_(take(p + "k_norm.weight") + offset)


def _load_mlp(layer: DecoderLayer, take: _Tensors, p: str, fused: bool) -> None:
    mlp = layer.mlp
    assert not isinstance(mlp, SparseMoE)
    if fused:
        mlp.gate_up.weight.copy_(take(p + "gate_up_proj.weight"))
    else:
        mlp.gate_up.weight.copy_(torch.cat([take(p + f"{n}_proj.weight") for n in ("gate", "up")]))
    mlp.down.weight.copy_(take(p + "down_proj.weight"))
    if mlp.gate_up.bias is not None and mlp.down.bias is not None:
        mlp.gate_up.bias.copy_(torch.cat([take(p + f"{n}_proj.bias") for n in ("gate", "up")]))
        mlp.down.bias.copy_(take(p + "down_proj.bias"))


def _load_experts(moe: SparseMoE, take: _Tensors, p: str, num_experts: int) -> None:
    if p + "mlp.experts.gate_up_proj" in take:  # transformers 5's stacked layout
        moe.load(take(p + "mlp.experts.gate_up_proj"), take(p + "mlp.experts.down_proj"), take(p + "mlp.gate.weight"))
        return
    if p + "mlp.experts.0.gate_proj.weight" in take:
        e, router = p + "mlp.experts.{}.", p + "mlp.gate.weight"
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    else:  # Mixtral's hub names
        e, router = p + "block_sparse_moe.experts.{}.", p + "block_sparse_moe.gate.weight"
        gate, up, down = "w1", "w3", "w2"
    gate_up = torch.stack([
        torch.cat([take(e.format(j) + f"{gate}.weight"), take(e.format(j) + f"{up}.weight")]) for j in range(num_experts)
    ])
    downs = torch.stack([take(e.format(j) + f"{down}.weight") for j in range(num_experts)])
    moe.load(gate_up, downs, take(router))


@torch.no_grad()
def load_quantized_into(model: CausalLM, state: dict[str, Any], bits: int, arena: WeightArena | None = None) -> None:
    """Load with every linear (and the embedding / LM head) weight-only quantized: quantized
    tensors (a GGUF's blocks, ``GGUFTensor``) are taken as they are, into ``arena`` where one is
    given, float ones quantized to ``bits``. No float copy of a linear weight is kept."""
    cfg = model.config
    if cfg.moe is not None:
        raise ValueError(f"{cfg.architecture}: quantized weights are not supported for mixtures of experts yet; "
                         "run it with weights='float'")
    dtype, offset, fused = model.embed.dtype, cfg.family.norm_offset, cfg.family.fused_checkpoint

    def q(name: str) -> QuantizedWeight | PackedWeight:
        if name not in state:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        value = state[name]
        if isinstance(value, GGUFTensor):
            return value.quantized(bits, arena)
        return value if isinstance(value, QuantizedWeight) else quantize(value, bits)

    def fused_rows(names: list[str]) -> QuantizedWeight | list[QuantizedWeight | PackedWeight]:
        parts = [q(n) for n in names]
        weights = [p for p in parts if isinstance(p, QuantizedWeight)]
        if len(weights) == len(parts) and len({p.bits for p in weights}) == 1:
            return cat_rows(weights)
        return parts  # one record array per run of one kind (QuantizedLinear)

    def floats(name: str) -> torch.Tensor:  # norms and biases: a GGUF's vectors are read as tensors
        value = state[name]
        assert isinstance(value, torch.Tensor), f"{name} is quantized; expected a float tensor"
        return value.to(dtype)

    def bias(names: list[str]) -> torch.Tensor | None:
        return torch.cat([floats(n) for n in names]) if all(n in state for n in names) else None

    model.weight_arena = arena
    embed = q("model.embed_tokens.weight")
    model.quantized_embed = QuantizedEmbedding(embed)
    model.embed = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        model.lm_head = model.quantized_embed.head  # type: ignore[assignment]
    else:
        model.lm_head = QuantizedLinear(q("lm_head.weight"), None)  # type: ignore[assignment]
    model.norm.weight.copy_(floats("model.norm.weight") + offset)
    for i, layer in enumerate(model.decoder_layers()):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn, mlp = layer.attn, layer.mlp
        qkv_names = [a + "qkv_proj.weight"] if fused else [a + f"{n}_proj.weight" for n in "qkv"]
        attn.qkv = QuantizedLinear(fused_rows(qkv_names), bias([a + f"{n}_proj.bias" for n in "qkv"]))  # type: ignore[assignment]
        attn.o = QuantizedLinear(q(a + "o_proj.weight"), None)  # type: ignore[assignment]
        if attn.q_norm is not None and attn.k_norm is not None:
            attn.q_norm.weight.copy_(floats(a + "q_norm.weight") + offset)
            attn.k_norm.weight.copy_(floats(a + "k_norm.weight") + offset)
        for ours, theirs in _NORM_NAMES[cfg.family.norm_layout]:
            getattr(layer, ours).weight.copy_(floats(p + theirs + ".weight") + offset)
        m = p + "mlp."
        assert not isinstance(mlp, SparseMoE)
        gate_up = [m + "gate_up_proj.weight"] if fused else [m + "gate_proj.weight", m + "up_proj.weight"]
        mlp.gate_up = QuantizedLinear(fused_rows(gate_up), bias([m + "gate_proj.bias", m + "up_proj.bias"]))  # type: ignore[assignment]
        mlp.down = QuantizedLinear(  # type: ignore[assignment]
            q(m + "down_proj.weight"), bias([m + "down_proj.bias"]))
