"""Model definitions and loading. ``load_model`` is the entry point."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixgen.host_memory import WeightArena
from radixgen.models.checkpoint import load_into, load_quantized_into
from radixgen.models.config import ModelConfig, config_code_digest
from radixgen.models.decoder import CausalLM
from radixgen.models.families import FAMILIES, supported_architectures
from radixgen.models.gguf_weights import records_arena
from radixgen.models.loader import (
    generation_defaults,
    gguf_file_of,
    gguf_index,
    gguf_tensor_types,
    load_state_dict,
    load_tokenizer,
    resolve_model_dir,
    save_gguf_index,
    weight_bits,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Any  # a transformers fast tokenizer
    path: Path
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    """The model's generation_config.json sampling fields, for requests that leave them out."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def build_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], *, dtype: torch.dtype,
    device: str | torch.device = "cpu", max_positions: int | None = None,
) -> CausalLM:
    with torch.device(device):
        model = CausalLM(cfg, dtype, max_positions or cfg.max_position_embeddings)
    load_into(model, state)
    return model.eval()


def build_quantized_model(
    cfg: ModelConfig, state: dict[str, Any], bits: int, *, dtype: torch.dtype, device: str | torch.device = "cpu",
    max_positions: int | None = None, arena: WeightArena | None = None,
) -> CausalLM:
    """A model whose linears and embedding are weight-only quantized to ``bits`` (tensors of
    ``state`` already quantized, from a GGUF file, are taken as they are, into ``arena``)."""
    with torch.device(device):
        model = CausalLM(cfg, dtype, max_positions or cfg.max_position_embeddings)
    load_quantized_into(model, state, bits, arena)
    return model.eval()


def _quantized_state(gguf_file: Path | None, cfg: ModelConfig, hf_config: Any, model_dir: Path,
                     index: dict[str, Any] | None) -> dict[str, Any]:
    """The tensors a quantized model loads: a GGUF's read from the file (its header parsed once
    and kept beside the converted config, with the model's config), other checkpoints' from their
    safetensors."""
    if gguf_file is None:
        return dict(load_state_dict(model_dir))
    from radixgen.models.gguf_weights import read_gguf, remove_old_caches

    remove_old_caches(model_dir)
    state, fresh = read_gguf(gguf_file, cfg, index, hf_config)
    fresh["model_config"] = {"code": config_code_digest(), "config": cfg.to_json()}
    if fresh != index:
        save_gguf_index(model_dir, fresh)
    return state


def _cached_config(index: dict[str, Any] | None) -> ModelConfig | None:
    """The config an earlier start of this GGUF derived (None: none, or derived by other code)."""
    cached = (index or {}).get("model_config")
    if not isinstance(cached, dict) or cached.get("code") != config_code_digest() or "hf_names" not in (index or {}):
        return None
    return ModelConfig.from_json(cached["config"])


def load_model(
    model: str | os.PathLike[str] | None = None, *, dtype: str = "float32", device: str = "cpu",
    weights: str = "auto",
) -> LoadedModel:
    """Load a checkpoint (HF folder, .gguf, hub id, or None for the bundled SmolLM2), its
    tokenizer and its generation config."""
    gguf_file = gguf_file_of(model)
    model_dir = resolve_model_dir(model, float_weights=gguf_file is None)
    # a converted cache folder passed as a folder is a float checkpoint like any other
    # off the CPU no kernel runs the quantized blocks yet: a GGUF's weights are dequantized at load
    bits = weight_bits(weights, gguf_tensor_types(model_dir) if gguf_file is not None else []) if device == "cpu" else None
    if bits is None and gguf_file is not None:
        model_dir = resolve_model_dir(model, float_weights=True)  # dequantized once, cached
    index = gguf_index(model_dir) if bits is not None and gguf_file is not None else None
    hf_config = None
    cfg = _cached_config(index)
    if cfg is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_dir)
        cfg = ModelConfig.from_hf(hf_config)
    generation_eos, sampling = generation_defaults(model_dir)
    # an instruct model's end-of-turn tokens are EOS too (Llama 3's <|eot_id|>, Qwen's <|im_end|>)
    run_cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + generation_eos)))
    if bits is None:
        net = build_model(run_cfg, load_state_dict(model_dir, device), dtype=torch_dtype(dtype), device=device)
        tokenizer = load_tokenizer(model_dir)
    else:
        state = _quantized_state(gguf_file, cfg, hf_config, model_dir, index)
        arena = records_arena(state)
        if arena is not None:  # its pages fault in (the kernel's zeroing and compaction) while the tokenizer loads
            arena.populate_in_background()
        tokenizer = load_tokenizer(model_dir)
        net = build_quantized_model(run_cfg, state, bits, dtype=torch_dtype(dtype), device=device, arena=arena)
        if arena is not None:
            arena.release_unused()
    return LoadedModel(model=net, config=run_cfg, tokenizer=tokenizer, path=model_dir, sampling_defaults=sampling)


__all__ = ["FAMILIES", "CausalLM", "LoadedModel", "ModelConfig", "build_model", "build_quantized_model", "load_model", "supported_architectures", "torch_dtype"]
