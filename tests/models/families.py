"""Tiny random-weight checkpoints of every supported family, with the features that tell the
family apart switched on: sliding windows shorter than the test prompts, soft-capping, q/k
norms, per-layer-type rotary, longrope and partial rotary, several experts.

Each is the transformers config class the real model uses, so transformers' own modeling code
is the reference. Shared by the tests and ``benchmarks/bench_offline.py --tiny-families``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WINDOW = 24
"""Sliding window of the windowed configs; the test prompts are longer."""

_COMMON: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)
_ALTERNATING = ["sliding_attention", "full_attention"] * 2


def family_configs() -> dict[str, Any]:
    """Case name -> transformers config. The real tokenizer's 49152-token vocabulary fits all."""
    import transformers as t

    return {
        "llama3.2": t.LlamaConfig(
            **_COMMON, tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}),
        "qwen2.5-window": t.Qwen2Config(
            **_COMMON, rope_theta=1e6, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
            tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
        "mistral-window": t.MistralConfig(**_COMMON, sliding_window=WINDOW, tie_word_embeddings=False),
        "ministral": t.MinistralConfig(**_COMMON, head_dim=16, sliding_window=WINDOW, layer_types=_ALTERNATING),
        "gemma": t.GemmaConfig(**_COMMON, head_dim=16),
        "gemma2": t.Gemma2Config(
            **_COMMON, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            query_pre_attn_scalar=24),
        "gemma3": t.Gemma3TextConfig(
            **_COMMON, head_dim=16, sliding_window=WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "phi3-longrope": t.Phi3Config(
            **_COMMON, pad_token_id=0, original_max_position_embeddings=128,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                          "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 128,
                          "factor": 8.0}),
        "phi4-mini-partial-rotary": t.Phi3Config(
            **_COMMON, partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=0),
        "olmo2": t.Olmo2Config(**_COMMON, pad_token_id=0),
        "qwen3-moe": t.Qwen3MoeConfig(
            **_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1]),
        "mixtral": t.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    }


def make_family_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """transformers' model of ``name`` (its config fields replaced by ``overrides``) with random
    weights large enough for O(1) logits; norm weights and biases perturbed too, so a misplaced
    norm or a dropped offset shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = family_configs()[name]
    if overrides:
        fields = {**config.to_dict(), **overrides}
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_family_model(name: str, path: Path, tokenizer: Any, seed: int = 0) -> Path:
    model = make_family_model(name, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
