"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) as one PyTorch model.

Differences between the members are config fields: GQA head counts, q/k/v bias (Qwen2), RoPE
scaling (llama3 / linear), tied embeddings (SmolLM, small Qwen2). The forward takes one flat
token stream for the whole batch plus an ``AttentionPlan``; there is no batch dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.models.attention import AttentionPlan, paged_attention
from radixgen.models.config import ModelConfig
from radixgen.models.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qk_size = q_size + kv_size
        self.rope = [rope]  # shared with the model; a list keeps it out of this module's children
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, dtype)
        self.o = Linear(q_size, cfg.hidden_size, False, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv(x)  # [T, (heads + 2 kv_heads) * head_dim]
        qk = qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = self.rope[0].rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, plan)  # [T, heads*head_dim]
        return self.o(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rope)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, plan, k_cache, v_cache)
        return x + self.mlp(self.post_attn_norm(x))


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
    ) -> torch.Tensor:
        """Return float32 logits [N, vocab] for the selected positions."""
        x = self.embed[input_ids]  # [T, hidden]
        cos, sin = self.rope.tables(positions)
        for layer, k_cache, v_cache in zip(self.decoder_layers(), k_caches, v_caches, strict=True):
            x = layer(x, cos, sin, plan, k_cache, v_cache)
        x = self.norm(x[logits_index])  # the norm is per row, so selecting first is exact
        return self.lm_head(x).float()

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
