"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing, then every expert's tokens in
one grouped matmul per projection.

The (token, expert) pairs are sorted by expert so that each expert's rows are contiguous, and
``torch._grouped_mm`` multiplies every group by its expert's weight in one call: no Python loop
over tokens or experts and no host sync (the group offsets stay a tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.models.config import MoeSpec
from radixgen.models.layers import Linear


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, spec: MoeSpec, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.act = act
        experts, inter = spec.num_experts, spec.intermediate_size
        self.router = Linear(hidden, experts, False, dtype)
        # [experts, in, out]: the layout grouped_mm multiplies rows by
        self.gate_up = nn.Parameter(torch.empty(experts, hidden, 2 * inter, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(experts, inter, hidden, dtype=dtype), requires_grad=False)

    def load(self, gate_up: torch.Tensor, down: torch.Tensor, router: torch.Tensor) -> None:
        """HF layouts: gate_up [experts, 2 * inter, hidden], down [experts, hidden, inter]."""
        self.gate_up.copy_(gate_up.transpose(1, 2))
        self.down.copy_(down.transpose(1, 2))
        self.router.weight.copy_(router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_k = self.spec.top_k
        # routing in float32, as transformers does
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k]
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_experts = experts.view(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of_pair = order // top_k  # pair p = token * k + slot
        # pairs per expert by a scatter: bincount on CUDA reads the largest id back to size its output
        counts = torch.zeros(self.spec.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        rows = x.index_select(0, token_of_pair)
        gate_up = torch._grouped_mm(rows, self.gate_up, offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        act = nn.functional.silu(gate) if self.act == "silu" else nn.functional.gelu(gate, approximate="tanh")
        out = torch._grouped_mm(act * up, self.down, offs=offsets)  # [pairs, hidden], sorted by expert
        out = out * weights.view(-1)[order].to(x.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token_of_pair, out)
