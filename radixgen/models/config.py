"""The one place where Hugging Face config fields are read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` (or anything with the same attributes)."""
        model_type = getattr(hf, "model_type", "llama")
        # Configs converted from GGUF carry no `architectures`; the model type names it then.
        arch = (getattr(hf, "architectures", None) or [_ARCH_BY_MODEL_TYPE.get(model_type, model_type)])[0]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
        attention_bias = bool(getattr(hf, "attention_bias", False)) or model_type == "qwen2"
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )


def _rope_dict(hf: Any) -> dict[str, Any]:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in `rope_theta` and
    # `rope_scaling`. Read both so either version's saved configs load.
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    return {**scaling, **params}


def _rope_theta(hf: Any) -> float:
    theta = _rope_dict(hf).get("rope_theta", getattr(hf, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _rope_scaling(hf: Any) -> RopeScaling:
    rope = _rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3"
        )
    return RopeScaling(
        kind=kind,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", 8192)
        ),
    )
