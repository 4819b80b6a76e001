"""Small building blocks: the linear layer, RMSNorm and the gated (SwiGLU) MLP used by experts and dense layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen_data.model.gemm_tuning import GemmPlan, available_kernels

# CPU GEMM kernel per weight shape and row count: measured on the running machine when the
# engine loads a model (``gemm_tuning.py``), merged into this process-wide table; shapes it has
# not measured use the static rule below, measured on this project's AMD EPYC (AVX2) machines:
# weight-left ``w @ x.T`` up to 256 rows, oneDNN for single rows and for wide weights (out
# features >= 4x in features), ``F.linear`` otherwise.
_WEIGHT_LEFT_MAX_ROWS = 256
_ONEDNN_MIN_WIDTH_RATIO = 4
_KERNELS = available_kernels()
_PLAN = GemmPlan()


def use_gemm_plan(plan: GemmPlan, kernels: dict | None = None) -> None:
    """Dispatch the plan's shapes by its measured choices (other shapes keep theirs); ``kernels``
    are the ones it chose among (the compiled skinny GEMM among them, where it was built)."""
    _KERNELS.update(kernels or {})
    _PLAN.choices.update(plan.choices)


def _static_choice(rows: int, n: int, k: int) -> str:
    if "onednn" in _KERNELS and (rows == 1 or n >= _ONEDNN_MIN_WIDTH_RATIO * k):
        return "onednn"
    return "weight_left" if rows <= _WEIGHT_LEFT_MAX_ROWS else "linear"


def chosen_kernel(rows: int, n: int, k: int) -> str:
    """The kernel ``linear`` runs for x [rows, k] @ w [n, k].T on CPU in fp32: the plan's, or the
    static rule's where the plan has no choice for the shape or names a kernel this process lacks."""
    name = _PLAN.kernel_for(rows, n, k)
    return name if name in _KERNELS else _static_choice(rows, n, k)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for x [M, K], w [N, K] -> [M, N], in the fastest GEMM for the shape.

    With few rows on CPU the result may be the transpose of a contiguous [N, M] product (a
    view); callers that need row-major memory call ``.contiguous()``.
    """
    if x.device.type != "cpu" or x.dim() != 2 or w.dtype != torch.float32:
        return F.linear(x, w, b)
    rows, (n, k) = x.shape[0], w.shape
    name = chosen_kernel(rows, n, k)
    if name == "linear":
        return F.linear(x, w, b)
    out = _KERNELS[name](x.contiguous(), w)
    return out if b is None else out + b


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
