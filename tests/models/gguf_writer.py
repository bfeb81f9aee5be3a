"""Write a tiny HF model as a GGUF file, as llama.cpp's converter lays one out, so the loader's
GGUF path can be tested on families other than the bundled one. The tokenizer metadata is
copied from the bundled SmolLM2 GGUF (the tiny models share its vocabulary), whole or cut to its
first tokens: transformers' GGUF reader parses the 49k-token vocabulary and its merges field by
field, seconds per read, and a load reads the file several times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# HF model_type -> GGUF architecture name (what transformers' GGUF reader maps back)
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "mistral": "llama"}


def _copy_tokenizer_fields(writer: Any, source: Path, vocab_size: int) -> None:
    """Below the source's size, keep the first ``vocab_size`` tokens and the merges made of them
    alone (BPE merges build on earlier ones, so the cut vocabulary is a whole, smaller tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(source)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    cut = vocab_size < len(tokens)
    kept = set(tokens[:vocab_size])
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = field.contents()
            if cut and key == "tokenizer.ggml.merges":
                values = [m for m in values if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
            elif cut and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                values = values[:vocab_size]
            writer.add_array(key, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, field.contents())
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, bool(field.contents()))
        else:
            writer.add_uint32(key, int(field.contents()))


def _llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the rotary halves of Llama q/k rows; the reader undoes it
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model: Any, path: Path, tokenizer_source: Path, linear_type: str = "F32") -> Path:
    """``linear_type``: the GGUF type of the 2-D weights (F32, Q8_0, Q4_0: quantized by the gguf
    package, as llama.cpp's quantizer lays the blocks out); norms stay F32. A model with fewer
    than the source's tokens gets the vocabulary cut to its size."""
    import gguf

    cfg = hf_model.config
    arch = _ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{cfg.model_type}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters.get("rope_theta", 10000.0)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if cfg.model_type == "gemma2":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    _copy_tokenizer_fields(writer, tokenizer_source, int(cfg.vocab_size))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.detach().float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = _llama_permute(w, heads)
        if cfg.model_type == "gemma2" and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's (1 + w)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = np.ascontiguousarray(w.numpy())
        if linear_type != "F32" and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[linear_type]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
