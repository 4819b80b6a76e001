"""Small building blocks: the linear layer, RMSNorm and the gated (SwiGLU) MLP used by experts and dense layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# GEMM layout on CPU, measured with the CPU build's MKL and oneDNN on this project's 2-core AMD
# EPYC (AVX2) machines for the expert, attention and lm_head shapes (docs/benchmarks.md):
# - up to ~256 rows, ``w @ x.T`` (the weight as the row-major left operand) runs 1.2-3x faster
#   than ``F.linear(x, w)``; from ~512 rows the two are even;
# - for wide weights (out features >= 4x in features: an expert's gate/up, the lm_head) oneDNN's
#   matmul beats both by 1.1-1.6x from 1 row up, and returns row-major output; with a single
#   row it is the fastest for every shape (1.2-1.6x).
_WEIGHT_LEFT_MAX_ROWS = 256
_ONEDNN_MIN_WIDTH_RATIO = 4


def _has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_HAS_ONEDNN_LINEAR = _has_onednn_linear()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for x [M, K], w [N, K] -> [M, N], in the fastest measured GEMM for the shape.

    With few rows on CPU the result may be the transpose of a contiguous [N, M] product (a
    view); callers that need row-major memory call ``.contiguous()``.
    """
    if x.device.type != "cpu" or x.dim() != 2 or w.dtype != torch.float32:
        return F.linear(x, w, b)
    if _HAS_ONEDNN_LINEAR and (x.shape[0] == 1 or w.shape[0] >= _ONEDNN_MIN_WIDTH_RATIO * w.shape[1]):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
    if x.shape[0] <= _WEIGHT_LEFT_MAX_ROWS:
        out = torch.mm(w, x.contiguous().t()).t()  # [M, N] view of [N, M]
        return out if b is None else out + b
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class GatedMLP:
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one weight.

    w_gate_up: [2F, H] (gate rows first, then up); w_down: [H, F].
    """

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        self.w_gate_up = w_gate_up
        self.w_down = w_down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.w_gate_up).chunk(2, dim=-1)  # [T, F] each
        return linear(F.silu(gate) * up, self.w_down)  # [T, H]


class SharedExpert:
    """Qwen2-MoE shared expert: a gated MLP scaled by ``sigmoid(x @ w_gate)`` per token."""

    def __init__(self, mlp: GatedMLP, w_gate: torch.Tensor):
        self.mlp = mlp
        self.w_gate = w_gate  # [1, H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(linear(x, self.w_gate)) * self.mlp(x)  # [T, H]
