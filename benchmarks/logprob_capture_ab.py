"""The logprobs capture alone, native statistics against torch's passes, alternating in one process.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/logprob_capture_ab.py

``token_logprobs`` with k=5 on [rows, 152,064] logits (the demo's vocabulary), the sampler's way
(rows overwritten in place), ``--reps`` alternating rounds of 11 calls each; the median ms per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data.engine.sample.logprob_capture import token_logprobs  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.model import native  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if native.load_native() is None:
        sys.exit("no native kernels on this machine")
    source = 4 * torch.randn(args.rows, args.vocab)
    tokens = source.argmax(-1)
    logits = source.clone()
    times: dict[str, list[float]] = {"torch": [], "native": []}
    for rep in range(args.reps):
        for name in (("torch", "native") if rep % 2 == 0 else ("native", "torch")):
            native.use_native_kernels(name == "native")
            for _ in range(11):
                logits.copy_(source)
                start = time.perf_counter()
                token_logprobs(logits, tokens, [5] * args.rows, overwrite=True)
                times[name].append(1e3 * (time.perf_counter() - start))
    t, n = statistics.median(times["torch"]), statistics.median(times["native"])
    print(f"{cpu_model()}: {args.rows} x {args.vocab} logits, k=5: torch passes {t:.2f} ms, "
          f"native statistics {n:.2f} ms ({t / n:.2f}x)")


if __name__ == "__main__":
    main()
