"""The chunked LM head's kernel alone: ``NativeKernels.lm_head_topk`` against the chunks' GEMMs.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/lm_head_kernel.py   # ~1 min

Random fp32 inputs shaped as the demo's greedy steps (``--rows`` x hidden 256 against a 151,936 x
256 LM head): the GEMM of every chunk alone (``CHUNK`` columns into one buffer, what any
chunked head pays), then ``lm_head_topk`` keeping the top 1 (plain greedy rows), 5 and 20 with
the log sum exp (logprobs), 16 and 64 (lazy grammar rows' candidates), and the top 1 under
grammar masks allowing 0.1%, 11% and 90% of the vocabulary (filled rows). Each case's time is
the median of ``--reps`` calls, and the cases alternate over ``--rounds`` rounds; reported: each
case's fastest round and its time over the GEMMs' (what the statistics add to the head). Writes
``lm-head-kernel-cpu.json`` under ``--out`` (default ``docs/results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.model.lm_head_topk import CHUNK  # noqa: E402
from batchgen_data.model.native import load_native  # noqa: E402

HIDDEN, VOCAB = 256, 151936  # the demo model's


def random_masks(rows: int, share: float, generator: torch.Generator) -> np.ndarray:
    """[rows, ceil(V / 32)] int32 bitmask words allowing a random ``share`` of the vocabulary."""
    allowed = torch.rand(rows, 32 * ((VOCAB + 31) // 32), generator=generator) < share
    allowed[:, VOCAB:] = False
    bits = allowed.view(rows, -1, 32).to(torch.int64) << torch.arange(32)
    return bits.sum(-1).numpy().astype(np.uint32).view(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    native = load_native()
    if native is None:
        raise SystemExit("the native kernels are not available here")
    g = torch.Generator().manual_seed(0)
    x, head = torch.randn(args.rows, HIDDEN, generator=g), 0.05 * torch.randn(VOCAB, HIDDEN, generator=g)
    every_row = np.arange(args.rows, dtype=np.int64)
    buffer = torch.empty(args.rows * CHUNK)

    def gemms():
        for start in range(0, VOCAB, CHUNK):
            width = min(CHUNK, VOCAB - start)
            torch.mm(x, head[start : start + width].t(), out=buffer[: args.rows * width].view(args.rows, width))

    def topk(k, with_norm, masks=None):
        return lambda: native.lm_head_topk(x, head, k, with_norm, CHUNK, masks)

    cases = {"gemms_alone": gemms, "top1": topk(1, False), "top5_logprobs": topk(5, True),
             "top20_logprobs": topk(20, True), "top16": topk(16, False), "top64": topk(64, False)}
    for share in (0.001, 0.11, 0.9):
        cases[f"top1_masked_{share:g}"] = topk(1, False, (every_row, random_masks(args.rows, share, g)))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            fn()
            calls = []
            for _ in range(args.reps):
                start = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - start)
            times[name].append(1e3 * statistics.median(calls))
    base = min(times["gemms_alone"])
    result = {"cpu": cpu_model(), "rows": args.rows, "torch_threads": torch.get_num_threads(),
              "ms": {name: min(t) for name, t in times.items()},
              "over_gemms": {name: min(t) / base for name, t in times.items()}, "rounds_ms": times}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm-head-kernel-cpu.json").write_text(json.dumps(result, indent=2))
    print(f"{result['cpu']}, {args.rows} rows, fastest of {args.rounds} rounds (median of {args.reps} calls each):")
    for name in cases:
        print(f"  {name:22s} {result['ms'][name]:7.2f} ms  {result['over_gemms'][name]:.3f}x the GEMMs alone")


if __name__ == "__main__":
    main()
