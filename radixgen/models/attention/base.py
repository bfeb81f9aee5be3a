"""The interface every attention backend implements, and the host plan the engine hands it.

A step's attention has two halves. Once per step, ``prepare`` turns the host plan
(``AttentionBatch``: numpy arrays the scheduler built) into whatever the backend's kernels read,
on the model's device; the backend owns those tensors. The model runner splits it in two so
that the step's inputs go up in one copy: ``host_arrays`` names the arrays the backend needs on
the device, the runner uploads them with the model's own inputs (``radixgen.staging.upload``),
and ``prepare_uploaded`` builds the metadata from the uploaded tensors. Then every layer calls
``forward`` with its queries and, where the model has not already written them, its new keys
and values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from radixgen.staging import upload


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the attention of layers and families: the q.k scale, a sliding
    window (keys a query sees, its own included) and tanh soft-capping of the scores."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass
class AttentionBatch:
    """One step's attention inputs on the host, as the scheduler planned them.

    B requests, T new tokens. The tokens are in request order; request b's new tokens sit at
    positions ``prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1`` of its sequence, and its
    whole sequence's pool slots are ``req_to_token[rows[b], :prefix_lens[b] + extend_lens[b]]``
    (written by the scheduler before the step).
    """

    rows: np.ndarray
    """[B] int64 req_to_token row of each request."""
    prefix_lens: np.ndarray
    """[B] int64 tokens of each request already in the pool before this step."""
    extend_lens: np.ndarray
    """[B] int64 new tokens of each request this step."""
    positions: np.ndarray
    """[T] int64 position of each new token in its sequence."""
    out_cache_loc: np.ndarray
    """[T] int64 pool slot receiving each new token's K/V."""
    is_decode: bool = False
    """Every request decodes exactly one token."""
    num_decode: int = 0
    """A mixed step: the last ``num_decode`` requests decode one token each (their tokens come
    last); the others prefill."""
    is_draft: bool = False
    """A speculative step: each request's extend is its newest token and its drafts, every one
    a query at its own position over K/V already in the pool."""

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    @property
    def num_prefill(self) -> int:
        return self.batch_size - self.num_decode

    def split_mixed(self) -> tuple[AttentionBatch, AttentionBatch]:
        """A mixed step as (its prefill part, its decode part)."""
        p, t = self.num_prefill, int(self.extend_lens[: self.num_prefill].sum())
        head = AttentionBatch(self.rows[:p], self.prefix_lens[:p], self.extend_lens[:p], self.positions[:t],
                              self.out_cache_loc[:t])
        tail = AttentionBatch(self.rows[p:], self.prefix_lens[p:], self.extend_lens[p:], self.positions[t:],
                              self.out_cache_loc[t:], is_decode=True)
        return head, tail


class AttentionMetadata:
    """What ``prepare`` made for one step. Every backend's metadata carries the new tokens'
    pool slots on the device (the fused rotary op writes K/V there itself)."""

    out_cache_loc: torch.Tensor
    """[T] int64 on the model's device."""


class DecodeGraphState(ABC):
    """A backend's decode metadata in static buffers, for a decode forward captured in a CUDA
    graph: the graph of a batch size reads ``metadata(size)``; each replay first ``load``s the
    step's arrays into the same buffers."""

    @abstractmethod
    def metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` entries of the static buffers (the same tensors on
        every call)."""

    @abstractmethod
    def load(self, size: int, uploaded: list[torch.Tensor]) -> None:
        """Copy a decode step's ``host_arrays`` (uploaded; ``size`` rows) into the buffers."""

    @abstractmethod
    def reset(self) -> None:
        """Fill the buffers with pad entries (valid to run: the pad slot, one key)."""


class AttentionBackend(ABC):
    """Attention over the token-level KV pool.

    Contract: ``prepare`` reads only the host plan and the backend's own state (it may upload,
    never read the device back); ``forward`` is called once per layer with q [T, heads, head_dim]
    and, unless the model already wrote them to the pool, the new tokens' k/v
    [T, kv_heads, head_dim], which it writes to ``k_cache``/``v_cache`` [slots, kv_heads,
    head_dim] at ``metadata.out_cache_loc`` before attending. It returns [T, heads * head_dim]
    in q's dtype: token t attends the keys of its request at positions up to its own (and
    within ``layer.window``), with ``layer.scale`` and ``layer.softcap``.
    """

    name: str
    device: torch.device
    supports_decode_graphs = False
    """Decode steps can be captured in CUDA graphs (``decode_graph_state``)."""

    def decode_graph_state(self, max_batch: int, max_seq_len: int) -> DecodeGraphState:
        """Static decode metadata for up to ``max_batch`` rows of up to ``max_seq_len`` keys."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run inside CUDA graphs")

    def host_arrays(self, batch: AttentionBatch) -> list[np.ndarray]:
        """The arrays ``prepare_uploaded`` needs on the device, in its order (none by default)."""
        return []

    @abstractmethod
    def prepare_uploaded(self, batch: AttentionBatch, uploaded: list[torch.Tensor]) -> AttentionMetadata:
        """The step's metadata; ``uploaded``: ``host_arrays(batch)`` on the device. Reads nothing
        back from the device."""

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        """``prepare_uploaded`` with the backend's arrays uploaded on their own."""
        return self.prepare_uploaded(batch, upload(self.host_arrays(batch), self.device))

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
        v_cache: torch.Tensor, layer: LayerAttention, metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


def write_kv(
    k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """The new tokens' K/V into their pool slots (nothing when the model wrote them)."""
    if k is not None and v is not None:
        k_cache.index_copy_(0, out_cache_loc, k)
        v_cache.index_copy_(0, out_cache_loc, v)
