"""One decoder-only transformer for every supported family (``families.py``).

The families differ in switches of ``ModelConfig``: where the norms sit (before each sublayer,
around it, or after it), q/k norms, the MLP's activation or a mixture of experts, sliding-window
and soft-capped attention, embedding scaling, per-layer-type rotary tables. The forward takes
one flat token stream for the whole batch plus the step's attention backend and its metadata;
there is no batch dimension.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixgen.models.attention import AttentionBackend, AttentionMetadata, LayerAttention
from radixgen.models.config import ModelConfig
from radixgen.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from radixgen.models.moe import SparseMoE
from radixgen.models.quantized import QuantizedEmbedding

if TYPE_CHECKING:
    from radixgen.host_memory import WeightArena

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """What every layer of one forward shares."""

    attention: AttentionBackend
    metadata: AttentionMetadata
    """What ``attention.prepare`` made of the step's plan."""
    positions: torch.Tensor  # [T]
    rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """[T, 1, head_dim] cos/sin per rotary embedding, for the unfused rotary path (once per step)."""

    def tables(self, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        if id(rope) not in self.rope_tables:
            self.rope_tables[id(rope)] = rope.tables(self.positions)
        return self.rope_tables[id(rope)]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.qk_size = q_size, q_size + kv_size
        self.rope = [rope]  # shared with the model; a list keeps it out of this module's children
        self.layer_attention = LayerAttention(cfg.scale, cfg.window_of(layer), cfg.attn_softcap)
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, dtype)
        self.o = Linear(q_size, cfg.hidden_size, False, dtype)
        self.qk_norm = cfg.family.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if self.qk_norm != "none":
            per_head = self.qk_norm == "head"
            in_float = cfg.family.norm_offset != 0 or self.qk_norm == "full"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else q_size, cfg.rms_norm_eps, dtype, in_float)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else kv_size, cfg.rms_norm_eps, dtype, in_float)
        # the fused rotary op rotates whole heads
        self.fused_rope = not rope.partial

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """q/k norms in place on qkv (the fused rotary op reads them from there)."""
        assert self.q_norm is not None and self.k_norm is not None
        num_tokens = qkv.shape[0]
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.qk_size]
        rows = self.head_dim if self.qk_norm == "head" else None
        q_in = q.reshape(-1, rows) if rows else q.contiguous()
        k_in = k.reshape(-1, rows) if rows else k.contiguous()
        q.copy_(self.q_norm(q_in).view(num_tokens, -1))
        k.copy_(self.k_norm(k_in).view(num_tokens, -1))

    def forward(self, x: torch.Tensor, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv(x)  # [T, (heads + 2 kv_heads) * head_dim]
        if self.q_norm is not None:
            self._norm_qk(qkv)
        rope = self.rope[0]
        if self.fused_rope:
            # rotary on q and k, and k/v written to the pool, in one op
            q = torch.ops.radixgen.rope_store_kv.default(
                qkv, step.positions, rope.cos, rope.sin, k_cache, v_cache, step.metadata.out_cache_loc, self.num_heads,
            )
            return self.o(step.attention.forward(q, None, None, k_cache, v_cache, self.layer_attention, step.metadata))
        cos, sin = step.tables(rope)
        qk = qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = rope.rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = step.attention.forward(q, k, v, k_cache, v_cache, self.layer_attention, step.metadata)  # [T, heads*head_dim]
        return self.o(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, rope: RotaryEmbedding) -> None:
        super().__init__()
        family = cfg.family
        self.layout = family.norm_layout
        in_float = family.norm_offset != 0 or self.layout == "post"

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, in_float)

        self.attn_in_norm = norm() if self.layout != "post" else None
        self.attn_out_norm = norm() if self.layout != "pre" else None
        self.mlp_in_norm = norm() if self.layout != "post" else None
        self.mlp_out_norm = norm() if self.layout != "pre" else None
        self.attn = Attention(cfg, layer, dtype, rope)
        self.mlp: GatedMLP | SparseMoE
        if cfg.moe is not None and cfg.moe_layers[layer]:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs, k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, or the embeddings with ``residual`` None.
        Returns (this layer's MLP output, the residual stream before it is added): the add is
        left to the next norm, which fuses it."""
        if self.attn_in_norm is None:  # post-norm: the sublayers read the residual stream itself
            residual = x if residual is None else residual + x
            h = residual
        elif residual is None:
            residual, h = x, self.attn_in_norm(x)
        else:
            h, residual = self.attn_in_norm.add_and_norm(x, residual)
        h = self.attn(h, step, k_cache, v_cache)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        if self.mlp_in_norm is None:
            residual = residual + h
            h = residual
        else:
            h, residual = self.mlp_in_norm.add_and_norm(h, residual)
        h = self.mlp(h)
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)
        return h, residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        family = cfg.family
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.quantized_embed: QuantizedEmbedding | None = None
        self.weight_arena: WeightArena | None = None
        """The huge-page mapping the loader wrote the quantized weights into (None: none; the
        runner moves them into one)."""
        """Set by a quantized load: the embedding rows dequantized on lookup (``embed`` is empty)."""
        # transformers rounds the scale to the model's dtype before multiplying
        self.embed_scale = (
            float(torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype)) if family.scale_embeddings else None
        )
        ropes = {name: RotaryEmbedding(cfg.head_dim, max_positions, spec, dtype) for name, spec in cfg.rope.items()}
        self.ropes = nn.ModuleList(ropes.values())
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, ropes[cfg.layer_types[i]]) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, family.norm_offset != 0 or family.norm_layout == "post")
        # A separate copy even when tied, so the head can live in oneDNN's packed layout.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        if any(rope.partial for rope in ropes.values()):
            logger.info("%s: partial rotary; rotary runs on PyTorch ops, not the fused native op", cfg.architecture)

    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]  # ModuleList items are typed as Module

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attention: AttentionBackend,
        metadata: AttentionMetadata,
        k_caches: torch.Tensor,  # [layers, slots, kv_heads, head_dim]
        v_caches: torch.Tensor,
        logits_index: torch.Tensor,  # [N] rows of T whose next-token logits are wanted
    ) -> torch.Tensor:
        """Return float32 logits [N, vocab] for the selected positions."""
        # [T, hidden]; a fresh tensor, so the residual may be updated in place
        x = self.embed[input_ids] if self.quantized_embed is None else self.quantized_embed(input_ids, self.norm.weight.dtype)
        if self.embed_scale is not None:
            x.mul_(self.embed_scale)
        step = StepInputs(attention, metadata, positions)
        residual: torch.Tensor | None = None
        for layer, k_cache, v_cache in zip(self.decoder_layers(), k_caches, v_caches, strict=True):
            x, residual = layer(x, residual, step, k_cache, v_cache)
        assert residual is not None
        # the norm is per row, so selecting first is exact
        x, _ = self.norm.add_and_norm(x[logits_index], residual[logits_index])
        logits = self.lm_head(x).float()
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds (parameters and weight buffers; rotary tables excluded)."""
        seen: set[int] = set()
        total = 0
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if name.startswith("ropes.") or tensor.data_ptr() in seen or not tensor.numel():
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
        for module in self.modules():
            packed = getattr(module, "_packed", None)
            if packed is not None:
                total += packed.numel() * packed.element_size()
        return total

    def set_small_linear_max_tokens(self, max_tokens: int) -> None:
        """Steps of at most ``max_tokens`` tokens run the linears as matrix-vector products over
        the plain weights (CPU; 0: never)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.small_linear_max_tokens = max_tokens

    def drop_plain_weights(self) -> None:
        """Free the plain copies of oneDNN-packed weights (the small-batch path then uses
        oneDNN too): saves the size of the model's linear weights in memory."""
        for module in self.modules():
            if isinstance(module, Linear) and module.weight is not self.embed:
                module.pack(keep_plain=False)
