"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) as one PyTorch model.

Differences between the members are config fields: GQA head counts, q/k/v bias (Qwen2), RoPE
scaling (llama3 / linear), tied embeddings (SmolLM, small Qwen2). The forward takes one flat
token stream for the whole batch plus an ``AttentionPlan``; there is no batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixgen.kernels import CpuKernels
from radixgen.models.attention import AttentionPlan, attend_pool, paged_attention
from radixgen.models.config import ModelConfig
from radixgen.models.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU


@dataclass
class StepInputs:
    """What every layer of one forward shares."""

    plan: AttentionPlan
    positions: torch.Tensor  # [T]
    kernels: CpuKernels | None
    """Native CPU ops; None runs PyTorch ops alone (other devices, or no compiler)."""
    cos: torch.Tensor | None = None  # [T, 1, head_dim] rotary tables, PyTorch path only
    sin: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qk_size = q_size + kv_size
        self.rope = [rope]  # shared with the model; a list keeps it out of this module's children
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, dtype)
        self.o = Linear(q_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens, kernels = x.shape[0], step.kernels
        qkv = self.qkv(x, kernels)  # [T, (heads + 2 kv_heads) * head_dim]
        if kernels is not None:
            # rotary on q and k, and k/v written to the pool, in one op
            rope = self.rope[0]
            q = kernels.rope_store_kv(
                qkv, step.positions, rope.cos, rope.sin, k_cache, v_cache, step.plan.out_cache_loc, self.num_heads,
            )
            return self.o(attend_pool(q, k_cache, v_cache, step.plan), kernels)
        assert step.cos is not None and step.sin is not None
        qk = qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = self.rope[0].rotate(qk, step.cos, step.sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, step.plan)  # [T, heads*head_dim]
        return self.o(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rope)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs, k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, or the embeddings with ``residual`` None.
        Returns (this layer's MLP output, the residual stream before it is added): the add is
        left to the next norm, which fuses it."""
        kernels = step.kernels
        if residual is None:
            residual, h = x, self.input_norm(x, kernels)
        else:
            h, residual = self.input_norm.add_and_norm(x, residual, kernels)
        h, residual = self.post_attn_norm.add_and_norm(self.attn(h, step, k_cache, v_cache), residual, kernels)
        return self.mlp(h, kernels), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, self.rope) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # A separate copy even when tied, so the head can live in oneDNN's packed layout.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)

    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]  # ModuleList items are typed as Module

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        plan: AttentionPlan,
        k_caches: torch.Tensor,  # [layers, slots, kv_heads, head_dim]
        v_caches: torch.Tensor,
        logits_index: torch.Tensor,  # [N] rows of T whose next-token logits are wanted
        kernels: CpuKernels | None = None,
    ) -> torch.Tensor:
        """Return float32 logits [N, vocab] for the selected positions."""
        x = self.embed[input_ids]  # [T, hidden]; a fresh tensor, so the residual may be updated in place
        step = StepInputs(plan, positions, kernels)
        if kernels is None:
            step.cos, step.sin = self.rope.tables(positions)
        residual: torch.Tensor | None = None
        for layer, k_cache, v_cache in zip(self.decoder_layers(), k_caches, v_caches, strict=True):
            x, residual = layer(x, residual, step, k_cache, v_cache)
        assert residual is not None
        # the norm is per row, so selecting first is exact
        x, _ = self.norm.add_and_norm(x[logits_index], residual[logits_index], kernels)
        return self.lm_head(x, kernels).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in, fusing q/k/v and gate/up and transposing linears."""
        cfg = self.config
        dtype = self.embed.dtype

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            return state[name].to(dtype)

        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight"))
            head = state.get("lm_head.weight") if not cfg.tie_word_embeddings else None
            self.lm_head.weight.copy_(head.to(dtype) if head is not None else self.embed)
            self.norm.weight.copy_(take("model.norm.weight"))
            for i, layer in enumerate(self.decoder_layers()):
                p = f"model.layers.{i}."
                attn, mlp = layer.attn, layer.mlp
                attn.qkv.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if attn.qkv.bias is not None:
                    attn.qkv.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                attn.o.weight.copy_(take(p + "self_attn.o_proj.weight"))
                mlp.gate_up.weight.copy_(torch.cat([take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]))
                mlp.down.weight.copy_(take(p + "mlp.down_proj.weight"))
                if mlp.gate_up.bias is not None and mlp.down.bias is not None:
                    mlp.gate_up.bias.copy_(torch.cat([take(p + f"mlp.{n}_proj.bias") for n in ("gate", "up")]))
                    mlp.down.bias.copy_(take(p + "mlp.down_proj.bias"))
                layer.input_norm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attn_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed  # the plain head the small-batch path reads: no second copy

    def drop_plain_weights(self) -> None:
        """Free the plain copies of oneDNN-packed weights (the small-batch path then uses
        oneDNN too): saves the size of the model's linear weights in memory."""
        for module in self.modules():
            if isinstance(module, Linear) and module.weight is not self.embed:
                module.pack(keep_plain=False)
