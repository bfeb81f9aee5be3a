"""HF checkpoint tensor names -> the decoder's parameters, for every family.

Linears are fused where the decoder fuses them (q/k/v, gate/up) unless the checkpoint already
stores them fused (Phi-3). Gemma's norms scale by (1 + weight): the 1 is folded into the weight
here, so every norm runs the same op. Expert weights are read in transformers 5's stacked
layout or the per-expert layout of hub checkpoints (``experts.{j}.gate_proj`` and Mixtral's
``block_sparse_moe.experts.{j}.w1/w2/w3``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixgen.models.moe import SparseMoE

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
