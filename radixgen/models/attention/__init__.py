"""Attention over the token-level KV pool, behind one interface (``base.AttentionBackend``).

Backends, chosen by ``EngineConfig.attention_backend``:

- ``cpu``: radixgen's native CPU kernels (decode, prefill, shared-prefix) with SDPA around them.
- ``torch``: request by request on PyTorch ops; the reference, and the path for any device.
- ``triton``: decode and extend kernels reading K/V in place through ``req_to_token``; CUDA's
  backend. On a CPU it runs under Triton's interpreter (tests only: it is slow).
- ``auto``: ``cpu`` on CPU, ``triton`` on CUDA (``torch`` where Triton is missing).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch

from radixgen.kernels import CpuKernels
from radixgen.models.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    DecodeGraphState,
    LayerAttention,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "torch", "triton")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionBatch", "AttentionMetadata", "DecodeGraphState", "LayerAttention",
           "create_backend", "resolve_backend"]


def _triton_available() -> bool:
    # found, not imported: importing it on a CPU before TRITON_INTERPRET is set would define its
    # language functions for compilation only
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` means on ``device`` (``auto`` resolved); unknown names are refused."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name != "auto":
        if name == "cpu" and device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU only; the model is on {device}")
        return name
    if device.type == "cpu":
        return "cpu"
    return "triton" if device.type == "cuda" and _triton_available() else "torch"


def create_backend(
    name: str, *, req_to_token: torch.Tensor, dtype: torch.dtype, head_dim: int, kernels: CpuKernels | None = None,
    cpu_choices: dict[str, str] | None = None,
) -> AttentionBackend:
    """The attention backend ``name`` for a pool whose ``req_to_token`` lives on the model's device.
    ``kernels``: the native CPU ops the ``cpu`` backend uses (None: its SDPA paths alone);
    ``cpu_choices``: its implementations measured on this machine (``models/tuning.py``)."""
    device = req_to_token.device
    resolved = resolve_backend(name, device)
    if resolved == "cpu":
        from radixgen.models.attention.cpu import CpuAttention

        return CpuAttention(req_to_token, dtype, head_dim, kernels, choices=cpu_choices)
    if resolved == "torch":
        from radixgen.models.attention.reference import TorchAttention

        return TorchAttention(req_to_token)
    if not _triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton compiles for GPUs; on a CPU its kernels run in its interpreter, which must be on
        # before triton.language (its own functions are kernels too) is first imported
        if "triton.language" in sys.modules:
            raise ValueError("attention_backend 'triton' on a CPU runs in Triton's interpreter, which must be on "
                             "before triton is imported: start the process with TRITON_INTERPRET=1")
        logger.warning("attention_backend 'triton' on a CPU runs in Triton's interpreter: correct, but slow")
        os.environ["TRITON_INTERPRET"] = "1"
    from radixgen.models.attention.triton_backend import TritonAttention

    return TritonAttention(req_to_token)
