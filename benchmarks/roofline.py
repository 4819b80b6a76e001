"""The roofline: model FLOPs over the matmul rate, and bytes over the memory bandwidth, measured on this machine.

The rate is the best sustained GFLOP/s of any GEMM kernel the engine may call (``F.linear``,
the weight-left ``w @ x.T`` and, on CPU, oneDNN's linear) on the experts' two shapes at a
large row count, so the roofline is the machine's ceiling, not the ceiling of the kernel the
engine happened to pick. The bandwidth is the rate of one full read of a buffer far larger than
the caches. ``step_floor_seconds`` bounds one engine step by both: no kernel can finish the
step's matmuls faster than the rate allows, nor read the weights and KV it touches faster than
the bandwidth allows.
"""

from __future__ import annotations

import time

import torch

from batchgen_data.model import ModelConfig
from batchgen_data.model.gemm_tuning import Kernel, available_kernels, time_pass

# The engine's CPU kernels (batchgen_data.model.gemm_tuning), under the names the JSON reports.
_KERNEL_NAMES = {"linear": "F.linear", "weight_left": "weight-left mm", "onednn": "oneDNN linear",
                 "skinny": "native skinny"}


def _kernels(device) -> dict[str, Kernel]:
    kernels = available_kernels(native=str(device) == "cpu")
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
    attention = float(config.num_hidden_layers * config.attention_flops_per_key * context_len)
    return weights + attention


def measure_streamed_gemm(kernel: Kernel, rows: int, in_features: int, out_features: int,
                          stream_bytes: int = 256 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """(GFLOP/s, weight GB/s) of ``kernel`` over distinct weights totalling ``stream_bytes``, as a
    decode step meets them: each weight read from memory once, not from a warm cache."""
    count = max(1, stream_bytes // (4 * in_features * out_features))
    weights = [torch.randn(out_features, in_features) for _ in range(count)]
    x = torch.randn(rows, in_features)
    time_pass(kernel, x, weights)  # warm-up
    per_call = min(time_pass(kernel, x, weights) for _ in range(repeats))
    return 2.0 * rows * in_features * out_features / per_call / 1e9, 4.0 * in_features * out_features / per_call / 1e9


def measure_memory_bandwidth(nbytes: int = 2**30, device="cpu", repeats: int = 3) -> float:
    """GB/s of reading an ``nbytes`` fp32 buffer once (a sum over it), the best of ``repeats``."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        _sync(device)
        start = time.perf_counter()
        buf.sum().item()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def step_floor_seconds(step: dict, config: ModelConfig, gflops: float, bandwidth_gbs: float,
                       dtype_bytes: int = 4) -> float:
    """The least time one engine step can take on this machine: its matmul FLOPs at ``gflops``
    or the weights and KV it reads at ``bandwidth_gbs``, whichever is longer.

    ``step`` is an engine timeline entry (``num_tokens``, ``num_sampled``, ``expert_calls``,
    ``context_tokens``, ``attended_keys``). Every forward reads each layer's attention and router
    weights, the weights of every (layer, expert) pair that ran, and the lm_head when it samples;
    each layer's attention reads every sequence's KV once.
    """
    h, ffn, vocab = config.hidden_size, config.moe_intermediate_size, config.vocab_size
    layers = config.num_hidden_layers
    flops = 2.0 * step["num_tokens"] * (config.active_params_per_token - vocab * h)  # all but the lm_head
    flops += 2.0 * step["num_sampled"] * vocab * h
    flops += float(layers * config.attention_flops_per_key * step["attended_keys"])
    # Bytes: every weight but the embedding table(s) and the routed experts, read each forward;
    # each expert that ran, once (the FLOPs count top-k experts per token); the lm_head to sample.
    num_sparse = sum(config.is_sparse_layer(i) for i in range(layers))
    tables = vocab * h * (1 if config.tie_word_embeddings else 2)
    weights = config.num_params - tables - num_sparse * config.num_experts * 3 * h * ffn
    weights += step["expert_calls"] * 3 * h * ffn + (vocab * h if step["num_sampled"] else 0)
    kv = config.kv_values_per_token * step["context_tokens"]  # every layer's KV (``KVSpec``s)
    nbytes = dtype_bytes * (weights + kv)
    return max(flops / (gflops * 1e9), nbytes / (bandwidth_gbs * 1e9))


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    """Print the streamed rate of every CPU kernel on the benchmark MoE's gate/up shape, by rows."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    args = parser.parse_args()
    print(f"memory bandwidth (one read of 1 GiB): {measure_memory_bandwidth():.1f} GB/s")
    print(f"gate/up weights [{2 * args.ffn}, {args.hidden}], 256 MiB of them streamed; GFLOP/s and weight GB/s:")
    kernels = _kernels("cpu")
    print(f"{'rows':>6}" + "".join(f"{name:>26}" for name in kernels))
    for rows in args.rows:
        rates = [measure_streamed_gemm(k, rows, args.hidden, 2 * args.ffn) for k in kernels.values()]
        print(f"{rows:>6}" + "".join(f"{gf:>14.0f} GF {gb:>5.1f} GB/s" for gf, gb in rates))


if __name__ == "__main__":
    main()
