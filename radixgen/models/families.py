"""The supported model families: what tells each apart from the Llama block.

Every family runs on the one decoder in ``radixgen/models/decoder.py``; an entry here says
which of its switches the family turns on. The values behind a switch (window sizes, caps,
expert counts, rope parameters) come from the checkpoint's config (``config.py``). Adding a
family whose block is a combination of these switches is one entry; one that needs a new kind
of block adds the switch to the decoder and an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    """HF ``architectures`` names; the first is the one a GGUF-converted config is given."""
    model_types: tuple[str, ...]
    norm_layout: Literal["pre", "sandwich", "post"] = "pre"
    """pre: norm before attention and MLP (Llama). sandwich: also a norm on each sublayer's
    output before the residual add (Gemma 2/3). post: only the output norms (OLMo 2)."""
    norm_offset: float = 0.0
    """RMSNorm scales by (offset + weight): Gemma stores weights around 0."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm on q and k before rotary: per head (Qwen3, Gemma 3) or over the whole projection
    (OLMo 2)."""
    scale_embeddings: bool = False
    """Multiply the embeddings by sqrt(hidden_size) (Gemma)."""
    attention_bias: bool = False
    """q/k/v biases whatever the config says (Qwen2)."""
    fused_checkpoint: bool = False
    """The checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)."""
    moe: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family("mistral", ("MistralForCausalLM",), ("mistral",)),
    Family("ministral", ("MinistralForCausalLM",), ("ministral",)),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), attention_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm="head"),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qk_norm="head", moe=True),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), moe=True),
    Family("gemma", ("GemmaForCausalLM",), ("gemma",), norm_offset=1.0, scale_embeddings=True),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), norm_layout="sandwich", norm_offset=1.0,
           scale_embeddings=True),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), norm_layout="sandwich", norm_offset=1.0,
           qk_norm="head", scale_embeddings=True),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), fused_checkpoint=True),
    Family("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), norm_layout="post", qk_norm="full"),
)

_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def family_of(hf: Any) -> Family:
    """The family of a transformers config: by ``architectures`` (what HF folders carry), else by
    ``model_type`` (configs converted from GGUF carry no architectures)."""
    for arch in getattr(hf, "architectures", None) or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    model_type = getattr(hf, "model_type", None)
    if not getattr(hf, "architectures", None) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    named = ", ".join(getattr(hf, "architectures", None) or ()) or f"model_type {model_type!r}"
    raise ValueError(f"architecture {named} is not supported; supported: {', '.join(supported_architectures())}")


def architecture_for_model_type(model_type: str) -> str | None:
    family = _BY_MODEL_TYPE.get(model_type)
    return family.architectures[0] if family else None
