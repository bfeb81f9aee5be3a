"""Model definitions and loading. ``load_model`` is the entry point."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixgen.models.config import ModelConfig
from radixgen.models.decoder import CausalLM
from radixgen.models.families import FAMILIES, supported_architectures
from radixgen.models.loader import generation_defaults, load_state_dict, resolve_model_dir

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
    model.load_hf_state_dict(state)
    return model.eval()


def load_model(
    model: str | os.PathLike[str] | None = None, *, dtype: str = "float32", device: str = "cpu",
) -> LoadedModel:
    """Load a checkpoint (HF folder, .gguf, hub id, or None for the bundled SmolLM2), its
    tokenizer and its generation config."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_dir(model)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    generation_eos, sampling = generation_defaults(model_dir)
    # an instruct model's end-of-turn tokens are EOS too (Llama 3's <|eot_id|>, Qwen's <|im_end|>)
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + generation_eos)))
    net = build_model(cfg, load_state_dict(model_dir), dtype=torch_dtype(dtype), device=device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LoadedModel(model=net, config=cfg, tokenizer=tokenizer, path=model_dir, sampling_defaults=sampling)


__all__ = ["FAMILIES", "CausalLM", "LoadedModel", "ModelConfig", "build_model", "load_model", "supported_architectures", "torch_dtype"]
