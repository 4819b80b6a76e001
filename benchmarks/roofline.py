"""The compute roofline: model FLOPs per token over the matmul rate measured on this machine."""

from __future__ import annotations

import time

import torch

from batchgen_data.model import ModelConfig


def measure_matmul_gflops(hidden: int, ffn: int, rows: int = 1024, dtype=torch.float32, device="cpu", seconds: float = 2.0) -> float:
    """Sustained GFLOP/s of a [rows, hidden] x [hidden, ffn] matmul (the experts' shape)."""
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.randn(ffn, hidden, dtype=dtype, device=device)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    _sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.linear(x, w)
        count += 1
    _sync(device)
    elapsed = time.perf_counter() - start
    return 2.0 * rows * hidden * ffn * count / elapsed / 1e9


def decode_flops_per_token(config: ModelConfig, context_len: int) -> float:
    """Matmul FLOPs of one decoded token: active weights (top-k experts, lm_head) plus attention."""
    weights = 2.0 * config.active_params_per_token
    attention = 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context_len
    return weights + attention


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
