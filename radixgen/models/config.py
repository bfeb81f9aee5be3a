"""The one place where Hugging Face config fields are read.

A ``ModelConfig`` is the decoder's shape plus the switches that tell the families apart (norm
placement and offset, q/k norms, activation, soft-capping, sliding windows, experts). Which
switches a family turns on is its ``Family`` entry in ``radixgen/models/families.py``; the
values (window sizes, caps, expert counts) are read from the checkpoint's config here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from radixgen.models import families
from radixgen.models.families import FAMILIES, Family, family_of

LayerType = Literal["full_attention", "sliding_attention"]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary frequencies of one layer type, computed by transformers' own rope functions."""

    inv_freq: tuple[float, ...]
    """[rotary_dim / 2]; rotary_dim < head_dim is partial rotary (the rest passes through)."""
    attention_factor: float = 1.0
    """Multiplies cos and sin (yarn, longrope)."""
    long_inv_freq: tuple[float, ...] | None = None
    """longrope: the frequencies of positions at or past ``long_from``."""
    long_from: int = 0

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    """Divide the top-k routing probabilities by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_types: tuple[LayerType, ...]
    rope: dict[str, RopeSpec]
    """Per layer type (a family with one rope has the same spec under every type it uses)."""
    sliding_window: int | None = None
    """Keys a sliding layer's query sees, its own included (transformers' convention)."""
    attention_scale: float = 0.0
    """Multiplies q.k; 0 means head_dim ** -0.5."""
    attn_softcap: float | None = None
    final_softcap: float | None = None
    hidden_act: str = "silu"
    moe: MoeSpec | None = None
    moe_layers: tuple[bool, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values (``from_json`` reads them back equal), cached beside a GGUF's
        index so that a later start skips transformers' config classes (seconds to import)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "family": self.family.name, "moe": dataclasses.asdict(self.moe) if self.moe else None,
                "rope": {kind: dataclasses.asdict(spec) for kind, spec in self.rope.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        fields = dict(data)
        fields["family"] = next(family for family in FAMILIES if family.name == data["family"])
        fields["moe"] = MoeSpec(**data["moe"]) if data["moe"] else None
        fields["rope"] = {kind: RopeSpec(tuple(spec["inv_freq"]), spec["attention_factor"],
                                         tuple(spec["long_inv_freq"]) if spec["long_inv_freq"] else None,
                                         spec["long_from"])
                          for kind, spec in data["rope"].items()}
        for name in ("eos_token_ids", "layer_types", "moe_layers"):
            fields[name] = tuple(data[name])
        return cls(**fields)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig``."""
        family = family_of(hf)
        arch = (getattr(hf, "architectures", None) or [family.architectures[0]])[0]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        num_layers = hf.num_hidden_layers
        layer_types = _layer_types(hf, num_layers)
        query_scalar = getattr(hf, "query_pre_attn_scalar", None)
        moe, moe_layers = _moe(hf, family, num_layers)
        return cls(
            architecture=arch,
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or family.attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            layer_types=layer_types,
            rope=_rope_specs(hf, set(layer_types), head_dim),
            sliding_window=getattr(hf, "sliding_window", None) if "sliding_attention" in layer_types else None,
            attention_scale=float(query_scalar) ** -0.5 if query_scalar else 0.0,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None) or None,
            final_softcap=getattr(hf, "final_logit_softcapping", None) or None,
            hidden_act=_activation(hf),
            moe=moe,
            moe_layers=moe_layers,
        )


def _layer_types(hf: Any, num_layers: int) -> tuple[LayerType, ...]:
    declared = getattr(hf, "layer_types", None)
    if declared:
        unknown = set(declared) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported; supported: full_attention, "
                             "sliding_attention")
        return tuple(declared)
    # Mistral names one window for every layer and no layer types
    window = getattr(hf, "sliding_window", None)
    return ("sliding_attention" if window else "full_attention",) * num_layers


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _activation(hf: Any) -> str:
    name = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _moe(hf: Any, family: Family, num_layers: int) -> tuple[MoeSpec | None, tuple[bool, ...]]:
    if not family.moe:
        return None, ()
    experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    spec = MoeSpec(
        num_experts=experts, top_k=hf.num_experts_per_tok,
        intermediate_size=getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
        renormalize=bool(getattr(hf, "norm_topk_prob", True)),
    )
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return spec, tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _rope_specs(hf: Any, layer_types: set[str], head_dim: int) -> dict[str, RopeSpec]:
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hasattr(hf, "standardize_rope_params"):
        hf.standardize_rope_params()
    params = getattr(hf, "rope_parameters", None) or {}
    per_type = bool(params) and set(params) <= {"full_attention", "sliding_attention"}
    specs = {}
    for layer_type in sorted(layer_types):
        rope = params[layer_type] if per_type else params
        kind = rope.get("rope_type", "default") or "default"
        kwargs = {"layer_type": layer_type} if per_type else {}
        if kind == "default":
            theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
            dim = int(head_dim * rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            specs[layer_type] = RopeSpec(tuple(inv.tolist()))
            continue
        if kind == "dynamic" or kind not in ROPE_INIT_FUNCTIONS:
            # dynamic NTK rescales every cached key as the sequence grows: a KV cache cannot hold it
            raise ValueError(f"rope type {kind!r} is not supported; supported: default, "
                             f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic'}))}")
        inv, factor = ROPE_INIT_FUNCTIONS[kind](hf, None, **kwargs)
        long_inv: tuple[float, ...] | None = None
        long_from = 0
        if kind == "longrope":
            long_from = int(rope.get("original_max_position_embeddings")
                            or hf.original_max_position_embeddings)
            long, _ = ROPE_INIT_FUNCTIONS[kind](hf, None, seq_len=long_from + 1, **kwargs)
            long_inv = tuple(long.float().tolist())
        if not math.isfinite(float(factor)):
            raise ValueError(f"rope type {kind!r} gave a non-finite attention factor")
        specs[layer_type] = RopeSpec(tuple(inv.float().tolist()), float(factor), long_inv, long_from)
    return specs


def config_code_digest() -> str:
    """Names the code that derives a ``ModelConfig`` from a checkpoint's config: a cached
    ``to_json`` is read back only while this is unchanged (a new field or family rule rebuilds it)."""
    digest = hashlib.sha256()
    for path in (Path(__file__), Path(families.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
