"""Expert weights and the expert-backend interface, with the native grouped-GEMM backend.

Shape legend: T = tokens, H = hidden, E = experts, K = experts per token, F = expert FFN size,
R = T * K routed token copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from batchgen_data.model.layers import linear
from batchgen_data.model.router import Routing


@dataclass(slots=True)
class ExpertWeights:
    """All experts of one layer stacked, so an expert is an index."""

    w_gate_up: torch.Tensor  # [E, 2F, H] gate rows first, then up rows
    w_down: torch.Tensor  # [E, H, F]

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]


@dataclass(slots=True)
class ExpertOutput:
    hidden: torch.Tensor  # [T, H] weighted sum over each token's experts
    tokens_per_expert: torch.Tensor  # [E] routed tokens each expert processed (int64, CPU)


class ExpertBackend(Protocol):
    """Runs one layer's experts: tokens in, tokens out, counts per expert.

    An expert-parallel backend holds only its rank's experts and exchanges tokens inside
    ``__call__``; callers see the same contract.
    """

    name: str

    def __call__(self, x: torch.Tensor, routing: Routing) -> ExpertOutput: ...


class NativeExperts:
    """Tokens grouped by expert, one GEMM pair per expert (or ``torch._grouped_mm``).

    NOTE: the algorithm: sort the R = T*K (token, expert) pairs by expert, gather the token rows
    once, run each expert on its contiguous segment, scale by the routing weight, and scatter-add
    back into [T, H]. One ``.tolist()`` of the counts is the only host sync.
    """

    name = "native"

    def __init__(self, weights: ExpertWeights, use_grouped_mm: bool | None = None):
        self.weights = weights
        if use_grouped_mm is None:
            use_grouped_mm = weights.w_gate_up.is_cuda and hasattr(torch, "_grouped_mm")
        self.use_grouped_mm = use_grouped_mm

    def __call__(self, x: torch.Tensor, routing: Routing) -> ExpertOutput:
        num_experts = self.weights.num_experts
        top_k = routing.topk_ids.shape[1]
        flat_ids = routing.topk_ids.reshape(-1)  # [R]
        order = torch.argsort(flat_ids, stable=True)  # [R]
        token_of_route = order // top_k  # [R]
        counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
        x_sorted = x[token_of_route]  # [R, H]
        if self.use_grouped_mm:
            y_sorted = self._grouped_mm(x_sorted, counts)
        else:
            y_sorted = self._loop(x_sorted, counts.tolist())
        y_sorted = y_sorted * routing.topk_weights.reshape(-1)[order, None]  # [R, H]
        out = torch.zeros_like(x).index_add_(0, token_of_route, y_sorted)  # [T, H]
        return ExpertOutput(hidden=out, tokens_per_expert=counts.cpu())

    def _loop(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        y_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            seg = x_sorted[start : start + count]  # [n, H]
            gate, up = linear(seg, self.weights.w_gate_up[expert]).chunk(2, dim=-1)  # [n, F]
            y_sorted[start : start + count] = linear(F.silu(gate) * up, self.weights.w_down[expert])
            start += count
        return y_sorted

    def _grouped_mm(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        gate_up = torch._grouped_mm(x_sorted, self.weights.w_gate_up.transpose(1, 2), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)  # [R, F]
        return torch._grouped_mm(F.silu(gate) * up, self.weights.w_down.transpose(1, 2), offs=offsets)


EXPERT_BACKENDS = ("native", "deepspeed")


def make_expert_backend(name: str, weights: ExpertWeights) -> ExpertBackend:
    """Build the named backend over one layer's expert weights."""
    if name == "native":
        return NativeExperts(weights)
    if name == "deepspeed":
        from batchgen_data.model.deepspeed_experts import DeepSpeedExperts

        return DeepSpeedExperts(weights)
    from batchgen_data.errors import ConfigError

    raise ConfigError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {name!r}")
