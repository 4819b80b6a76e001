"""Small building blocks: RMSNorm and the gated (SwiGLU) MLP used by experts and dense layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)  # [T, F] each
        return F.linear(F.silu(gate) * up, self.w_down)  # [T, H]


class SharedExpert:
    """Qwen2-MoE shared expert: a gated MLP scaled by ``sigmoid(x @ w_gate)`` per token."""

    def __init__(self, mlp: GatedMLP, w_gate: torch.Tensor):
        self.mlp = mlp
        self.w_gate = w_gate  # [1, H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.w_gate)) * self.mlp(x)  # [T, H]
