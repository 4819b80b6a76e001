"""The compute roofline: model FLOPs per token over the matmul rate measured on this machine.

The rate is the best sustained GFLOP/s of any GEMM kernel the engine may call (``F.linear``,
the weight-left ``w @ x.T`` and, on CPU, oneDNN's linear) on the experts' two shapes at a
large row count, so the roofline is the machine's ceiling, not the ceiling of the kernel the
engine happened to pick.
"""

from __future__ import annotations

import time

import torch

from batchgen_data.model import ModelConfig
from batchgen_data.model.gemm_tuning import Kernel, available_kernels

# The engine's CPU kernels (batchgen_data.model.gemm_tuning), under the names the JSON reports.
_KERNEL_NAMES = {"linear": "F.linear", "weight_left": "weight-left mm", "onednn": "oneDNN linear"}


def _kernels(device) -> dict[str, Kernel]:
    kernels = available_kernels()
    if str(device) != "cpu":
        kernels.pop("onednn", None)
    return {_KERNEL_NAMES[name]: kernel for name, kernel in kernels.items()}


def measure_kernel_gflops(kernel: Kernel, rows: int, in_features: int, out_features: int,
                          dtype=torch.float32, device="cpu", seconds: float = 1.0) -> float:
    """Sustained GFLOP/s of ``kernel(x [rows, in], w [out, in])``."""
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    w = torch.randn(out_features, in_features, dtype=dtype, device=device)
    for _ in range(3):
        kernel(x, w)
    _sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        kernel(x, w)
        count += 1
    _sync(device)
    elapsed = time.perf_counter() - start
    return 2.0 * rows * in_features * out_features * count / elapsed / 1e9


def measure_matmul_rates(hidden: int, ffn: int, rows: int = 1024, dtype=torch.float32, device="cpu",
                         seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s per (kernel, shape) for the experts' gate/up [H -> 2F] and down [F -> H] GEMMs."""
    shapes = {"gate_up": (hidden, 2 * ffn), "down": (ffn, hidden)}
    return {
        f"{name} {shape}": measure_kernel_gflops(kernel, rows, k, n, dtype, device, seconds)
        for name, kernel in _kernels(device).items()
        for shape, (k, n) in shapes.items()
    }


def decode_flops_per_token(config: ModelConfig, context_len: int) -> float:
    """Matmul FLOPs of one decoded token: active weights (top-k experts, lm_head) plus attention."""
    weights = 2.0 * config.active_params_per_token
    attention = 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context_len
    return weights + attention


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
