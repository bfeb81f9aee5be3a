"""A GGUF file's tensors, by their HF names, as the file holds them: quantized blocks of the
supported types are written into the kernel's records (``PackedWeight``) straight from a
read-only mmap of the file, F32 / F16 / BF16 tensors are read as they are, and nothing is written
to disk. A start reads the file again (its page cache makes a second start fast) instead of
keeping a second copy of it.

Names: each HF name of the architecture (the keys of transformers' model built on the meta
device) is mapped to its GGUF name by the gguf package's tensor name map, as transformers'
own GGUF reader does. Llama-architecture q/k rows were permuted by llama.cpp's converter; the
permutation is undone on the rows of the blocks. Gemma's stored norm weights are 1 + w.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixgen.host_memory import WeightArena
from radixgen.kernels import quant_layout
from radixgen.models.config import ModelConfig
from radixgen.models.gguf_file import GGUFFile, TensorInfo
from radixgen.models.quantized import PackedWeight, QuantizedWeight, quantize

logger = logging.getLogger(__name__)

RECORD_KINDS = {"Q4_0": quant_layout.OFFSET4, "Q4_1": 4, "Q5_0": quant_layout.OFFSET5, "Q5_1": 5, "Q8_0": 8,
                "Q4_K": quant_layout.K4, "Q5_K": quant_layout.K5, "Q6_K": quant_layout.K6}
"""The quantized types run as they are, and the record kind each is written into."""
BLOCK_TYPES = tuple(RECORD_KINDS)
FLOAT_TYPES = ("F32", "F16", "BF16")

# In a folder of its own: beside model.safetensors, tools that load every *.safetensors of a
# checkpoint folder (vLLM) would take the blocks for weights. Earlier releases cached the
# repacked blocks there (the file's size again); a start now removes them.
_OLD_CACHES = ("radixgen-gguf/blocks.safetensors", "gguf-blocks.safetensors")
LEGACY_CACHE_NAME = _OLD_CACHES[1]


@dataclass
class GGUFTensor:
    """One tensor of the file, read when the model takes it (so the file's pages of a tensor are
    let go before the next is read)."""

    file: GGUFFile
    info: TensorInfo
    row_order: torch.Tensor | None = None
    """Rows to take in this order (llama's q/k), or None."""

    @property
    def type_name(self) -> str:
        return self.info.type_name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def record_shape(self) -> tuple[int, int, int] | None:
        """The shape of the records ``blocks`` writes (None where it writes none: the caller
        dequantizes)."""
        from radixgen.kernels import cpu_kernels

        if self.type_name not in RECORD_KINDS or len(self.shape) != 2 or cpu_kernels() is None:
            return None
        rows, cols = self.shape
        return -(-rows // quant_layout.BLOCK_ROWS), cols // quant_layout.GROUP, \
            quant_layout.record_bytes(RECORD_KINDS[self.type_name])

    def blocks(self, arena: WeightArena | None = None) -> PackedWeight | None:
        """The kernel's records of a quantized 2-D tensor of a supported type, written into
        ``arena`` where it has room (None where the native ops are not built here: the caller
        dequantizes)."""
        from radixgen.kernels import cpu_kernels

        shape, kernels = self.record_shape(), cpu_kernels()
        if shape is None or kernels is None:
            return None
        raw = self.file.raw(self.info.name)
        if self.row_order is not None:
            raw = raw[self.row_order].contiguous()
        records = arena.take(shape) if arena is not None else None
        if records is None:
            records = kernels.gguf_repack(raw, self.info.ggml_type, self.shape[1])
        else:
            kernels.gguf_repack_into(raw, self.info.ggml_type, self.shape[1], records)
        del raw
        self.file.release(self.info.name)
        return PackedWeight(records, RECORD_KINDS[self.type_name], self.shape[0])

    def floats(self) -> torch.Tensor:
        """The tensor in float32 (float types converted, quantized ones dequantized by the gguf
        package's reference)."""
        import gguf

        raw = self.file.raw(self.info.name).numpy().reshape(-1)
        try:
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(self.info.ggml_type))
        except NotImplementedError:
            raise ValueError(
                f"{self.file.path.name}: tensor {self.info.name!r} is {self.type_name}, which cannot be read "
                f"here; supported: {', '.join(BLOCK_TYPES + FLOAT_TYPES)}") from None
        out = torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.shape))
        self.file.release(self.info.name)
        return out[self.row_order] if self.row_order is not None else out

    def quantized(self, bits: int, arena: WeightArena | None = None) -> PackedWeight | QuantizedWeight:
        """As the quantized model holds it: the file's own blocks where they run as they are (in
        ``arena``), else the values quantized to ``bits`` (a block type without a kernel is said,
        with its cost)."""
        blocks = self.blocks(arena)
        if blocks is not None:
            return blocks
        if self.type_name not in BLOCK_TYPES + FLOAT_TYPES:
            weight = quantize(self.floats(), 8)
            logger.warning("%s: tensor %r is %s, which has no kernel here (supported: %s); it is held as 8-bit "
                           "blocks (%.1f MiB, %.1fx its size in the file)", self.file.path.name, self.info.name,
                           self.type_name, ", ".join(BLOCK_TYPES), weight.nbytes() / 2**20,
                           weight.nbytes() / self.info.nbytes)
            return weight
        return quantize(self.floats(), bits)


def records_arena(state: dict[str, Any]) -> WeightArena | None:
    """An arena for the records of ``state``'s tensors (None where none are written)."""
    shapes = [shape for value in state.values()
              if isinstance(value, GGUFTensor) and (shape := value.record_shape()) is not None]
    return WeightArena(WeightArena.bytes_for(math.prod(shape) for shape in shapes)) if shapes else None


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's interleaving of the rotary halves (its converter's
    ``permute``, reversed as transformers' reader does)."""
    index = torch.arange(rows)
    dim = rows // heads // 2
    return index.reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def tensor_types(path: Path) -> list[str]:
    return sorted({t.type_name for t in GGUFFile(path).tensors.values()})


def remove_old_caches(cache_folder: Path) -> None:
    for name in _OLD_CACHES:
        (cache_folder / name).unlink(missing_ok=True)


def read_gguf(path: Path, cfg: ModelConfig, index: dict[str, Any] | None = None, hf_config: Any = None,
              ) -> tuple[dict[str, torch.Tensor | GGUFTensor], dict[str, Any]]:
    """The file's tensors by HF name: vectors (norms, biases) as float tensors, matrices read
    lazily (``GGUFTensor``); and the index to pass next time for this file (its parsed header
    and the names' map: finding the names imports transformers' model class, seconds, and needs
    ``hf_config``, the transformers config, where ``index`` has no map)."""
    file = GGUFFile(path, index.get("header") if index else None)
    arch = file.architecture
    to_hf = index.get("hf_names") if index else None
    if not isinstance(to_hf, dict):
        if hf_config is None:
            raise ValueError(f"{path.name}: its tensor names are not indexed yet; pass the transformers config")
        to_hf = _hf_names(arch, hf_config)
    out: dict[str, torch.Tensor | GGUFTensor] = {}
    for info in file.tensors.values():
        hf_name = to_hf.get(info.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        order = None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            order = _unpermute_rows(info.shape[0], cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
        tensor = GGUFTensor(file, info, order)
        if len(info.shape) > 1:
            out[hf_name] = tensor
            continue
        value = tensor.floats()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):  # stored as 1 + w
            value = value - 1
        out[hf_name] = value
    return out, {"header": file.to_index(), "hf_names": to_hf}


def _hf_names(arch: str, hf_config: Any) -> dict[str, str]:
    """GGUF tensor name -> HF name for the architecture."""
    import gguf
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf_config.num_hidden_layers)
    to_hf = {}
    for hf_name in names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
    return to_hf
