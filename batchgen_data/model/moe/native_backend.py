"""The native expert backend: tokens grouped by expert, one GEMM pair per expert.

Shape legend: T = tokens, H = hidden, E = experts, K = experts per token, R = T * K routes.
"""

from __future__ import annotations

import torch

from batchgen_data.model.layers import linear
from batchgen_data.model.moe.experts import (
    SWIGLU,
    ExpertActivation,
    ExpertOutput,
    ExpertWeights,
    SwiGLU,
    expert_ffn,
)
from batchgen_data.model.moe.native_experts import fused_swiglu_experts
from batchgen_data.model.moe.router import Routing
from batchgen_data.model.moe.store import ExpertStore, in_batches


class NativeExperts:
    """Tokens grouped by expert, one GEMM pair per expert (or ``torch._grouped_mm``).

    NOTE: the algorithm: sort the R = T*K (token, expert) pairs by expert, gather the token rows
    once, ask the store for the weights of the experts that got tokens (in runs of at most the
    store's ``capacity``, ascending: a bounded pool may not hold them all at once), run each
    expert on its contiguous segment, scale by the routing weight, and scatter-add back into
    [T, H]. Each segment's result is independent of how the experts were batched, so a bounded
    store gives the same bits as a resident one. One ``.tolist()`` of the counts is the only
    host sync.
    """

    name = "native"

    def __init__(self, store: ExpertStore, layer_id: int, activation: ExpertActivation = SWIGLU,
                 use_grouped_mm: bool | None = None):
        self.store, self.layer_id, self.activation = store, layer_id, activation
        if use_grouped_mm is None:
            sample = store.weights(layer_id, [])
            use_grouped_mm = (sample.w_gate_up.is_cuda and hasattr(torch, "_grouped_mm") and store.capacity is None
                              and sample.b_gate_up is None and isinstance(activation, SwiGLU))
        self.use_grouped_mm = use_grouped_mm
        self.decode_table = None  # the decode kernels' expert table, cached by ``fused_decode``

    def __call__(self, x: torch.Tensor, routing: Routing) -> ExpertOutput:
        num_experts = self.store.num_experts
        top_k = routing.topk_ids.shape[1]
        flat_ids = routing.topk_ids.reshape(-1)  # [R]
        order = torch.argsort(flat_ids, stable=True)  # [R]
        token_of_route = order // top_k  # [R]
        counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
        x_sorted = x[token_of_route]  # [R, H]
        count_list = counts.tolist()
        used = [e for e, n in enumerate(count_list) if n]
        weights = self.store.weights(self.layer_id, used) if self.use_grouped_mm else None
        if weights is not None and weights.row_of is None:
            y_sorted = self._grouped_mm(x_sorted, counts, weights)
        else:
            y_sorted = fused_swiglu_experts(self.store, self.layer_id, self.activation, x_sorted, count_list, used)
            if y_sorted is None:
                y_sorted = self._loop(x_sorted, count_list, used)
        y_sorted = y_sorted * routing.topk_weights.reshape(-1)[order, None]  # [R, H]
        out = torch.zeros_like(x).index_add_(0, token_of_route, y_sorted)  # [T, H]
        return ExpertOutput(hidden=out, tokens_per_expert=counts.cpu())

    def _loop(self, x_sorted: torch.Tensor, counts: list[int], used: list[int]) -> torch.Tensor:
        y_sorted = torch.empty_like(x_sorted)
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        for batch in in_batches(self.store, used):
            weights = self.store.weights(self.layer_id, batch)
            for expert in batch:
                lo, hi = starts[expert], starts[expert + 1]
                y_sorted[lo:hi] = expert_ffn(x_sorted[lo:hi], weights, weights.row(expert), self.activation, linear)  # [n, H]
        return y_sorted

    @staticmethod
    def _grouped_mm(x_sorted: torch.Tensor, counts: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        gate_up = torch._grouped_mm(x_sorted, weights.w_gate_up.transpose(1, 2), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)  # [R, F]
        return torch._grouped_mm(SWIGLU(gate, up), weights.w_down.transpose(1, 2), offs=offsets)
