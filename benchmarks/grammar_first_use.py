"""What the first constrained request of a fresh engine costs a short job (issue #54): the job's
time with a grammar the engine has never built anything for, against the same rows without it.

Each repetition starts a new engine (as a new actor or process would: no tokenizer view, no
compiled grammar), runs a small plain warm-up (kernels, allocator; no grammar), then the measured
pair in alternating order: N rows greedy for L tokens each (``ignore_eos``) plain, and the same
rows constrained by ``--regex``. ``--table stored`` keeps the grammar token table an earlier
engine wrote on disk (``engine/structured/token_table.py``: every process after the first on a
machine); ``--table none`` deletes it before each engine starts (the first process ever). The
figure is the median over repetitions of the ratio constrained / plain job time; the engines'
start-up seconds are reported beside it.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/grammar_first_use.py \\
        --sizes 1,8,16,48,64 --tokens 16 --reps 3 --table stored
    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/grammar_first_use.py --start-ab 6
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from feature_costs import timed_generate

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.hardware import cpu_model
from batchgen_data.paths import cache_dir


def _job_s(engine: Engine, prompts: list[str], params: SamplingParams) -> float:
    return timed_generate(engine, prompts, params)[0]


def point(size: int, tokens: int, regex: str, reps: int, table: str) -> dict:
    prompts = [f"Ticket {i}: the parcel arrived late and the box was {'wet' if i % 3 else 'torn'}." for i in range(size)]
    plain = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured_outputs={"regex": regex})
    ratios, starts, plain_s, first_s = [], [], [], []
    for rep in range(reps):
        if table == "none":
            shutil.rmtree(cache_dir() / "grammar-token-tables", ignore_errors=True)
        started = time.perf_counter()
        engine = Engine("demo", EngineConfig(max_num_seqs=max(size, 4), max_num_batched_tokens=2048))
        starts.append(time.perf_counter() - started)
        try:
            engine.generate(["warm up"] * 4, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            if rep % 2 == 0:
                base = _job_s(engine, prompts, plain)
                first = _job_s(engine, prompts, constrained)
            else:
                first = _job_s(engine, prompts, constrained)
                base = _job_s(engine, prompts, plain)
        finally:
            engine.close()
        plain_s.append(base)
        first_s.append(first)
        ratios.append(first / base)
    result = {"rows": size, "tokens": tokens, "table": table, "ratios": [round(r, 4) for r in ratios],
              "median_ratio": round(statistics.median(ratios), 4), "plain_s": [round(s, 4) for s in plain_s],
              "first_use_s": [round(s, 4) for s in first_s], "engine_start_s": [round(s, 3) for s in starts]}
    print(json.dumps(result), flush=True)
    return result


def start_ab(pairs: int) -> dict:
    """Engine start-up with the token table stored (its views built beside the model load) and
    without it, alternating which goes first: what building ahead costs a start."""
    tables = cache_dir() / "grammar-token-tables"
    aside = cache_dir() / "grammar-token-tables.aside"
    if not tables.is_dir():
        raise SystemExit("no stored token table: run a constrained job once first (--table stored)")
    starts: dict[str, list[float]] = {"stored": [], "none": []}
    for pair in range(pairs):
        for mode in ("stored", "none") if pair % 2 == 0 else ("none", "stored"):
            if mode == "none":
                tables.rename(aside)
            try:
                started = time.perf_counter()
                engine = Engine("demo", EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048))
                starts[mode].append(round(time.perf_counter() - started, 3))
                engine.close()
            finally:
                if mode == "none":
                    aside.rename(tables)
    result = {"engine_start_s": starts, "median_s": {m: statistics.median(v) for m, v in starts.items()}}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,16,48,64")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--regex", default="[a-z]{400}")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--table", choices=["stored", "none"], default="stored")
    parser.add_argument("--start-ab", type=int, default=0, metavar="PAIRS",
                        help="only time engine starts with the stored table and without it, PAIRS alternating pairs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.start_ab:
        result = start_ab(args.start_ab)
        if args.out is not None:
            args.out.write_text(json.dumps({"cpu": cpu_model(), **result}, indent=2) + "\n")
        return
    points = [point(int(s), args.tokens, args.regex, args.reps, args.table) for s in args.sizes.split(",")]
    worst = max(points, key=lambda p: p["median_ratio"])
    print(f"worst point: {worst['median_ratio']:.3f}x at {worst['rows']} rows x {worst['tokens']} tokens "
          f"(table {args.table})")
    if args.out is not None:
        args.out.write_text(json.dumps({"cpu": cpu_model(), "regex": args.regex, "points": points, "worst": worst},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
