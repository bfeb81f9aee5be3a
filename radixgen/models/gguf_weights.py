"""A GGUF file's tensors, by their HF names, with Q4_0 / Q4_1 / Q8_0 blocks repacked as
``QuantizedWeight`` (no float round trip) and every other type as a float tensor.

Names: each HF name of the architecture (the keys of transformers' model built on the meta
device) is mapped to its GGUF name by the gguf package's tensor name map, as transformers'
own GGUF reader does. Llama-architecture q/k rows were permuted by llama.cpp's converter; the
permutation is undone on the rows of the blocks. Gemma's stored norm weights are 1 + w.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixgen.models.quantized import QuantizedWeight

# block layouts: bytes per 32 weights
_Q4_0, _Q4_1, _Q8_0 = 18, 20, 34


def _fp16(blocks: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].copy())


def _repack(kind: str, data: np.ndarray, rows: int) -> QuantizedWeight:
    width = {"Q4_0": _Q4_0, "Q4_1": _Q4_1, "Q8_0": _Q8_0}[kind]
    blocks = data.reshape(rows, -1, width)
    scales = _fp16(blocks, 0)
    if kind == "Q8_0":
        signed = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
        return QuantizedWeight(torch.from_numpy(signed.copy()), scales, torch.empty(0), 8)
    if kind == "Q4_1":
        mins, nibbles = _fp16(blocks, 2), blocks[..., 4:]
    else:  # Q4_0: w = (q - 8) * d
        mins, nibbles = -8 * scales, blocks[..., 2:]
    q = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(rows, -1).copy())
    return QuantizedWeight(q, scales.contiguous(), mins.contiguous(), 4)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's interleaving of the rotary halves (its converter's
    ``permute``, reversed as transformers' reader does)."""
    index = torch.arange(rows)
    dim = rows // heads // 2
    return index.reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def tensor_types(path: Path) -> list[str]:
    import gguf

    return sorted({t.tensor_type.name for t in gguf.GGUFReader(path).tensors})


# In a folder of its own: beside model.safetensors, tools that load every *.safetensors of a
# checkpoint folder (vLLM) would take the blocks for weights.
_CACHE_NAME = "radixgen-gguf/blocks.safetensors"
LEGACY_CACHE_NAME = "gguf-blocks.safetensors"


def cached_gguf(path: Path, hf_config: Any, cache_folder: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    """``read_gguf`` once, then from a safetensors copy of the repacked blocks in the model's
    cache folder (parsing the file's metadata alone took ~5 s per start for the bundled one)."""
    from safetensors.torch import load_file, save_file

    cache = cache_folder / _CACHE_NAME
    if cache.exists():
        flat = load_file(str(cache))
        out: dict[str, torch.Tensor | QuantizedWeight] = {}
        for key, tensor in flat.items():
            name, _, part = key.rpartition("::")
            if part == "float":
                out[name] = tensor
            elif part == "qweight":
                out[name] = QuantizedWeight(tensor, flat[name + "::scales"], flat[name + "::mins"],
                                            int(flat[name + "::bits"].item()))
        return out
    weights = read_gguf(path, hf_config)
    flat = {}
    for name, value in weights.items():
        if isinstance(value, QuantizedWeight):
            flat.update({name + "::qweight": value.qweight, name + "::scales": value.scales,
                         name + "::mins": value.mins, name + "::bits": torch.tensor(value.bits)})
        else:
            flat[name + "::float"] = value.contiguous()
    cache.parent.mkdir(exist_ok=True)
    (cache_folder / LEGACY_CACHE_NAME).unlink(missing_ok=True)  # an earlier release's copy, beside the weights
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")  # servers starting together each write their own
    save_file(flat, str(tmp))
    tmp.replace(cache)
    return weights


def read_gguf(path: Path, hf_config: Any) -> dict[str, torch.Tensor | QuantizedWeight]:
    import gguf
    from transformers import AutoModelForCausalLM

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf_config.num_hidden_layers)
    to_hf = {}
    for hf_name in names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in reader.tensors:
        hf_name = to_hf.get(tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        kind = tensor.tensor_type.name
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
        value: torch.Tensor | QuantizedWeight
        if kind in ("Q4_0", "Q4_1", "Q8_0") and len(shape) == 2:
            value = _repack(kind, np.asarray(tensor.data), shape[0])
        else:
            floats = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            value = torch.from_numpy(np.array(floats, dtype=np.float32).reshape(shape))
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in hf_name else hf_config.num_key_value_heads
            order = _unpermute_rows(shape[0], heads)
            value = value.rows(order) if isinstance(value, QuantizedWeight) else value[order]
        if arch.startswith("gemma") and hf_name.endswith("norm.weight") and isinstance(value, torch.Tensor):
            value = value - 1
        out[hf_name] = value
    return out
