"""Peak memory of a CLI job against the size of its input: bounded by the parts in flight.

Writes a JSONL input of ROWS rows, each a short prompt and ``--columns`` string columns of
``--bytes`` bytes, runs ``batchgen-data run`` over it in a fresh process (the demo model, one
output token a row, a 256 MiB KV pool), and reports the process's peak RSS (``wait4``'s ``ru_maxrss``) for each row
count. The same rows without the string columns run beside them as the baseline: the engine's
own memory grows with the rows it has run (its KV pool's pages become resident as blocks are
first used; glibc's heap fragments), so the input's share is the difference, ``input_share_mib``.
A job that held its whole input would see that share grow with the rows; one that streams parts
keeps it flat.

    python benchmarks/input_memory.py --rows 10000,100000 --columns 10 --bytes 5000

``--format parquet --compressible`` writes the input as Parquet whose strings are a 1 KB random
chunk repeated (Snappy then stores them in ~1/50 of their size): 100,000 rows of 10 x 50 KB
strings are ~48 GiB in memory, as the job holds them, but ~1 GiB on disk in and out, which fits
a disk that 48 GiB of JSONL in and Parquet out would not.

``--pythonpath DIR`` runs another tree's code (a ``git worktree`` of an earlier commit) for a
before/after. Writes OUTPUT (default ``docs/results/input-memory-cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchgen_data.hardware import cpu_model


def write_input(path: Path, num_rows: int, num_columns: int, num_bytes: int, compressible: bool = False) -> None:
    rng = random.Random(0)
    if compressible:
        chunks = ["".join(rng.choices(string.ascii_letters + " ", k=1000)) for _ in range(64)]
        blocks = [(chunk * (num_bytes // 1000 + 1))[:num_bytes] for chunk in chunks]
    else:
        blocks = ["".join(rng.choices(string.ascii_letters + " ", k=num_bytes)) for _ in range(64)]
    if path.suffix == ".parquet":
        _write_parquet(path, num_rows, num_columns, blocks)
        return
    with open(path, "w") as f:
        for i in range(num_rows):
            row = {"id": i, "prompt": f"Ticket {i}: the parcel arrived late."}
            row.update({f"text{c}": blocks[(i + c) % len(blocks)] for c in range(num_columns)})
            f.write(json.dumps(row) + "\n")


def _write_parquet(path: Path, num_rows: int, num_columns: int, blocks: list[str], group: int = 256) -> None:
    """The same rows as Parquet, a row group at a time (the whole table would not fit in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    try:
        for start in range(0, num_rows, group):
            ids = range(start, min(num_rows, start + group))
            columns = {"id": list(ids), "prompt": [f"Ticket {i}: the parcel arrived late." for i in ids]}
            columns.update({f"text{c}": [blocks[(i + c) % len(blocks)] for i in ids] for c in range(num_columns)})
            table = pa.table(columns)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def run_job(input_path: Path, output: Path, pythonpath: str | None, rows_per_part: int, kv_bytes: int) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "batchgen_data.jobs.cli", "run", str(input_path), str(output),
                             "--max-tokens", "1", "--no-progress", "--rows-per-part", str(rows_per_part),
                             "--kv-cache-memory-bytes", str(kv_bytes)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=output.parent)  # not this checkout: `-m` puts the cwd first on sys.path
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the job failed: {stderr[-2000:]}")
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "seconds": round(time.perf_counter() - start, 1),
            "summary": stdout.strip().splitlines()[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000,100000")
    parser.add_argument("--columns", type=int, default=10)
    parser.add_argument("--bytes", type=int, default=5000)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", help="the input file's format")
    parser.add_argument("--compressible", action="store_true",
                        help="strings of a 1 KB chunk repeated: the same bytes in memory, ~1/50 of them on disk")
    parser.add_argument("--rows-per-part", type=int, default=256)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 2**20,
                        help="the engine's KV pool: its pages become resident as blocks are first used, "
                             "so a small pool reaches its full size early and the rows' share shows")
    parser.add_argument("--pythonpath", default=None, help="run this tree's code instead")
    parser.add_argument("--workdir", type=Path, default=None, help="where inputs and outputs go (default: a temp folder)")
    parser.add_argument("--output", type=Path, default=Path("docs/results/input-memory-cpu.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="input-memory-", dir=args.workdir))
    results = []
    try:
        for num_rows in [int(n) for n in args.rows.split(",")]:
            path = workdir / f"in-{num_rows}.{args.format}"
            write_input(path, num_rows, args.columns, args.bytes, args.compressible)
            result = run_job(path, workdir / f"out-{num_rows}", args.pythonpath, args.rows_per_part,
                             args.kv_cache_memory_bytes)
            result.update(rows=num_rows, input_mib=round(path.stat().st_size / 2**20, 1),
                          strings_mib=round(num_rows * args.columns * args.bytes / 2**20, 1))
            path.unlink()
            shutil.rmtree(workdir / f"out-{num_rows}")
            write_input(path, num_rows, 0, 0)
            baseline = run_job(path, workdir / f"out-{num_rows}", args.pythonpath, args.rows_per_part,
                               args.kv_cache_memory_bytes)
            result.update(baseline_peak_rss_mib=baseline["peak_rss_mib"],
                          input_share_mib=round(result["peak_rss_mib"] - baseline["peak_rss_mib"], 1))
            results.append(result)
            print(json.dumps(result), flush=True)
            path.unlink()
            shutil.rmtree(workdir / f"out-{num_rows}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"cpu": cpu_model(), "columns": args.columns, "bytes": args.bytes, "format": args.format,
              "compressible": args.compressible,
              "rows_per_part": args.rows_per_part, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
              "pythonpath": args.pythonpath, "results": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
