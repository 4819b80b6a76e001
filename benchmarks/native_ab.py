"""The throughput benchmark's engine run with the native CPU kernels and with torch's only, in
alternating child processes (``BATCHGEN_DATA_NATIVE_KERNELS``), so the pairs share the machine's
state:

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/native_ab.py --pairs 2

Each child runs ``benchmarks.throughput.run_batchgen`` on the ``--quick`` workload (256 requests,
the 206 M-parameter Mixtral) and prints its output tok/s and steady decode tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child() -> None:
    sys.path.insert(0, str(ROOT))
    from batchgen_data.model import ModelConfig
    from batchgen_data.paths import cache_dir
    from benchmarks.throughput import run_batchgen
    from benchmarks.workload import BENCH_MODELS, build_bench_model, make_workload

    folder = cache_dir() / BENCH_MODELS["mixtral"][0]
    build_bench_model(folder, arch="mixtral")
    workload = make_workload(256, 64, 48, ModelConfig.from_pretrained(folder).vocab_size)
    args = argparse.Namespace(device="cpu", dtype="auto", max_num_seqs=256, attention_batch_size=64,
                              max_num_batched_tokens=2048, tune_gemms=True)
    result = run_batchgen(folder, workload, args)
    print(json.dumps({"tokens_per_s": result["tokens_per_s"], "steady": result["steady_decode_tokens_per_s"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child()
        return
    runs: dict[str, list[dict]] = {"native": [], "torch": []}
    for _ in range(args.pairs):
        for mode in ("native", "torch"):
            env = dict(os.environ, BATCHGEN_DATA_NATIVE_KERNELS="1" if mode == "native" else "0")
            proc = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                                  check=True)
            runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(mode, runs[mode][-1], flush=True)
    for mode, results in runs.items():
        print(f"{mode}: median {statistics.median(r['tokens_per_s'] for r in results):.0f} output tok/s, steady decode "
              f"{statistics.median(r['steady'] for r in results):.0f} tok/s")
    print("native / torch per pair:", [round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                                       for a, b in zip(runs["native"], runs["torch"])])


if __name__ == "__main__":
    main()
