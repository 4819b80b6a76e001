"""An engine's resident memory against the rows it has run, with and without ``heap.trim_heap``
after every chunk of rows (what ``HeapTrimmer`` does after batches in the stages).

Each mode runs in a fresh process: the demo model, one-token rows in chunks of ``--chunk``, a
256 MiB KV pool; after each chunk the process's RSS (``/proc/self/statm``), and at the end the
wall time and the peak (``ru_maxrss``).

    python benchmarks/heap_trim.py --rows 16000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from batchgen_data.hardware import cpu_model


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def probe(trim: bool, rows: int, chunk: int) -> dict:
    from batchgen_data import Engine, EngineConfig, SamplingParams
    from batchgen_data.heap import trim_heap

    engine = Engine("demo", EngineConfig(max_num_seqs=256, kv_cache_memory_bytes=256 << 20))
    params = SamplingParams(max_tokens=1, temperature=0)
    curve, trim_s = [], 0.0
    start = time.perf_counter()
    for done in range(0, rows, chunk):
        engine.generate([f"Ticket {i}: the parcel arrived late and the box was {'wet' if i % 3 else 'torn'}."
                         for i in range(done, done + chunk)], params)
        if trim:
            t0 = time.perf_counter()
            trim_heap()
            trim_s += time.perf_counter() - t0
        curve.append([done + chunk, round(_rss_mib(), 1)])
    return {"trim": trim, "seconds": round(time.perf_counter() - start, 2), "trim_s": round(trim_s, 3),
            "rss_mib": curve, "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16000)
    parser.add_argument("--chunk", type=int, default=2000)
    parser.add_argument("--mode", choices=("trim", "no-trim"), default=None, help="(internal) one mode, here")
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(probe(args.mode == "trim", args.rows, args.chunk)))
        return
    results = []
    for mode in ("no-trim", "trim"):
        out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--chunk", str(args.chunk),
                              "--mode", mode], check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"cpu": cpu_model(), "rows": args.rows, "results": results}))


if __name__ == "__main__":
    main()
