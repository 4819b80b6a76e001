"""Prefix caching benchmark: a templated ETL workload with caching on vs off, in the same run.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/prefix_cache.py   # ~4 min

Workloads (token ids on a small random Mixtral, hidden 512, 8 experts, vocabulary 2,048):
  * templated: ``--templates`` instruction templates x ``--rows`` rows each, a ``--instruction``-token
    instruction then an 8-24-token row part, interleaved in input order (row i uses template
    i mod N), as data teams write such files;
  * control: the same number of prompts of the same lengths with nothing shared.
Each runs on a fresh engine with ``enable_prefix_caching`` off, on, then off again (the off time
is their mean; a warm-up first), ``--max-tokens`` greedy tokens per row. Reports wall time, tokens/s, prefill tokens
computed vs logical and vs the ideal (each template once plus the row parts), the hit rate, and
whether outputs are identical; then the templated file through the CLI with ``--workers 2`` vs
one worker (hit rates). Writes ``prefix_cache.json`` and ``prefix_cache.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from benchmarks.workload import BENCH_MODELS, build_bench_model  # noqa: E402

_ARCH = "mixtral_small"


def make_prompts(args, shared: bool, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """The prompts and the ideal prefill (each distinct instruction once, plus the row parts)."""
    rng = random.Random(seed)
    templates = [[rng.randrange(3, vocab) for _ in range(args.instruction)] for _ in range(args.templates)]
    prompts, ideal = [], args.templates * args.instruction if shared else 0
    for i in range(args.templates * args.rows):
        part = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
        head = templates[i % args.templates] if shared else [rng.randrange(3, vocab) for _ in range(args.instruction)]
        prompts.append(head + part)
        ideal += len(part) + (0 if shared else args.instruction)
    return prompts, ideal


def run_engine(folder: Path, prompts: list[list[int]], caching: bool, args) -> dict:
    engine = Engine(folder, EngineConfig(enable_prefix_caching=caching, max_num_seqs=args.max_num_seqs))
    warm = [[7, 8, 9, 10] * 8] * 2  # untimed: allocator and kernels (shares nothing with the workload)
    engine.generate(warm, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    base = engine.stats()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    forward = stats.num_forward_tokens - base.num_forward_tokens
    decode = sum(o.num_generated_tokens - 1 for o in outputs)  # every token after the first
    queries = stats.prefix_cache_queries - base.prefix_cache_queries
    hits = stats.prefix_cache_hits - base.prefix_cache_hits
    return {
        "caching": caching, "wall_s": wall,
        "output_tokens_per_s": sum(o.num_generated_tokens for o in outputs) / wall,
        "prompt_tokens_per_s": sum(len(p) for p in prompts) / wall,
        "prefill_tokens_computed": forward - decode, "prefill_tokens_logical": sum(len(p) for p in prompts),
        "hit_rate": hits / queries if queries else 0.0,
        "outputs": [o.token_ids for o in outputs],
    }


def run_cli(folder: Path, prompts: list[list[int]], workers: int, args, tmp: Path) -> dict:
    data = tmp / "templated.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp / f"out-{workers}"
    cmd = [sys.executable, "-m", "batchgen_data.jobs.cli", "run", str(data), str(out), "--model", str(folder),
           "--max-tokens", str(args.max_tokens), "--rows-per-part", str(args.rows_per_part), "--workers",
           str(workers), "--output-format", "jsonl", "--no-progress"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for f in sorted(out.glob("part-*.jsonl")) for line in f.read_text().splitlines()]
    inputs = sum(r["num_input_tokens"] for r in rows)
    return {"workers": workers, "wall_s": wall, "rows": len(rows),
            "hit_rate": sum(r["num_cached_tokens"] or 0 for r in rows) / inputs if inputs else 0.0}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(report["workloads"])
    for i, caching in enumerate((False, True)):
        runs = [report["workloads"][n]["on" if caching else "off"] for n in names]
        xs = [j + 0.38 * i for j in range(len(names))]
        label = "caching on" if caching else "caching off"
        ax1.bar(xs, [r["prompt_tokens_per_s"] for r in runs], width=0.36, label=label)
        ax2.bar(xs, [r["prefill_tokens_computed"] for r in runs], width=0.36, label=label)
    for ax, title in ((ax1, "prompt tokens / s"), (ax2, "prefill tokens computed")):
        ax.set_xticks([j + 0.19 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    ideal = report["workloads"]["templated"]["ideal_prefill"]
    ax2.axhline(ideal, color="k", ls="--", lw=1)
    ax2.text(0.02, ideal, " ideal (templated)", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--templates", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16, help="rows per template")
    parser.add_argument("--instruction", type=int, default=384, help="tokens of each instruction")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rows-per-part", type=int, default=8, help="CLI part size (parts spread over workers)")
    parser.add_argument("--skip-cli", action="store_true", help="skip the CLI --workers comparison")
    parser.add_argument("--out", type=Path, default=Path("runs/prefix_cache"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("BATCHGEN_DATA_CACHE", Path.home() / ".cache" / "batchgen-data"))
    folder = cache / BENCH_MODELS[_ARCH][0]
    build_bench_model(folder, arch=_ARCH)
    vocab = BENCH_MODELS[_ARCH][1]["vocab_size"]
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    for name, shared in (("templated", True), ("control", False)):
        prompts, ideal = make_prompts(args, shared, vocab)
        # Off, on, off: the off time is the mean of the runs before and after, so warming up
        # over the run favours neither.
        off = run_engine(folder, prompts, False, args)
        on = run_engine(folder, prompts, True, args)
        off_again = run_engine(folder, prompts, False, args)
        off["wall_s_runs"] = [off["wall_s"], off_again["wall_s"]]
        off["wall_s"] = (off["wall_s"] + off_again["wall_s"]) / 2
        identical = sum(a == b == c for a, b, c in zip(off.pop("outputs"), on.pop("outputs"), off_again["outputs"]))
        report["workloads"][name] = {"off": off, "on": on, "ideal_prefill": ideal, "identical": identical,
                                     "speedup": off["wall_s"] / on["wall_s"], "num_prompts": len(prompts)}
        print(f"{name}: {len(prompts)} prompts, off {off['wall_s']:.2f} s, on {on['wall_s']:.2f} s "
              f"= {off['wall_s'] / on['wall_s']:.2f}x; prefill computed {on['prefill_tokens_computed']} "
              f"(off {off['prefill_tokens_computed']}, logical {on['prefill_tokens_logical']}, ideal {ideal}, "
              f"{on['prefill_tokens_computed'] / ideal - 1:+.1%} of ideal); hit rate {on['hit_rate']:.1%}; "
              f"outputs identical {identical}/{len(prompts)}", flush=True)
    if not args.skip_cli:
        prompts, _ = make_prompts(args, True, vocab)
        with tempfile.TemporaryDirectory() as tmp:
            cli = [run_cli(folder, prompts, w, args, Path(tmp)) for w in (1, 2)]
        report["cli"] = cli
        print("CLI, templated file: " + "; ".join(
            f"--workers {c['workers']}: hit rate {c['hit_rate']:.1%} in {c['wall_s']:.1f} s ({c['rows']} rows)"
            for c in cli), flush=True)
    t = report["workloads"]["templated"]
    c = report["workloads"]["control"]
    report["targets"] = {
        "templated_3x": t["speedup"] >= 3.0,
        "prefill_within_10pct_of_ideal": t["on"]["prefill_tokens_computed"] <= 1.1 * t["ideal_prefill"],
        "control_0.97x": c["speedup"] >= 0.97,
        "identical": t["identical"] == t["num_prompts"] and c["identical"] == c["num_prompts"],
    }
    if "cli" in report:
        report["targets"]["workers_2_hit_rate_within_10_points"] = \
            report["cli"][0]["hit_rate"] - report["cli"][1]["hit_rate"] <= 0.10
    print("targets:", report["targets"])
    (args.out / "prefix_cache.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "prefix_cache.png")
    print(f"wrote {args.out / 'prefix_cache.json'} and {args.out / 'prefix_cache.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
