"""A MoE layer's routed experts in one native call, where decode's few rows per expert make the
per-op cost of the torch loop (two GEMMs, chunk, silu, multiply and a copy per expert) count.

It applies where the GEMM plan already runs the experts' GEMMs on the native skinny kernel (few
rows on CPU in fp32), for SwiGLU experts without biases whose weights are all resident; every
other case keeps ``NativeExperts._loop``.
"""

from __future__ import annotations

import torch

from batchgen_data.model.layers import chosen_kernel
from batchgen_data.model.moe.experts import ExpertActivation, SwiGLU
from batchgen_data.model.moe.store import ExpertStore
from batchgen_data.model.native import active_native


def fused_swiglu_experts(store: ExpertStore, layer_id: int, activation: ExpertActivation, x_sorted: torch.Tensor,
                         counts: list[int], used: list[int]) -> torch.Tensor | None:
    """y_sorted [R, H] for the rows of ``x_sorted`` grouped by expert (``counts`` per expert id),
    or None where the native kernel does not apply."""
    if not isinstance(activation, SwiGLU) or x_sorted.device.type != "cpu" or x_sorted.dtype != torch.float32:
        return None
    if store.capacity is not None or not used:  # bounded (streamed) stores overlap fetch with compute
        return None
    module = active_native()
    if module is None:
        return None
    weights = store.weights(layer_id, used)
    if weights.b_gate_up is not None or weights.wait_row is not None or weights.w_gate_up.dtype != torch.float32:
        return None
    two_f, hidden = weights.w_gate_up.shape[1:]
    if chosen_kernel(max(counts), two_f, hidden) != "skinny":
        return None
    starts = [0]  # ``used`` ascends, and experts between them have no rows: segments follow in order
    for expert in used:
        starts.append(starts[-1] + counts[expert])
    rows = [weights.row(expert) for expert in used]
    return module.swiglu_experts(x_sorted, starts, rows, weights.w_gate_up, weights.w_down)
