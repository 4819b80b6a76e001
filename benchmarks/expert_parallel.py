"""Expert-parallel benchmark: the same skewed workload at 1 rank and at N ranks, in one run.

    .venv/bin/python benchmarks/expert_parallel.py              # CPU, N = 2, ~5 min
    .venv/bin/python benchmarks/expert_parallel.py --ranks ray,local --requests 96   # Ray-placed vs local ranks
    bash benchmarks/expert_parallel_gpu.sh                       # 8 GPUs, NCCL, bf16 (untested)

For each size it reports output tokens/s, the share of the ranks' step time spent in the MoE
collectives (the two all-to-alls and the exchange of expert counts before them), split into
waiting for the last rank to arrive and the exchange itself, idle (zero-token) steps per rank, each rank's resident
expert weights against the model's, and each rank's peak resident memory; and whether the greedy
tokens of every request are identical across sizes. Targets (issue #16): identical tokens; each
rank's expert weights at most 1/N of the model's + 5%; all-to-all at most 15% of step time at
N = 2 on CPU. Writes ``expert_parallel.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.engine.executor.rank_resources import peak_rss_bytes  # noqa: E402
from batchgen_data.model import ModelConfig  # noqa: E402
from benchmarks.workload import BENCH_MODELS, build_bench_model, make_workload, percentile  # noqa: E402


def expert_weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Every routed expert of every sparse layer (gate, up and down), as the config counts it."""
    sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    return sparse * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * dtype_bytes


def run(folder: Path, workload, ranks: int, args) -> dict:
    config = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          attention_batch_size=args.attention_batch_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, expert_parallel_size=ranks,
                          expert_backend=args.expert_backend, collect_timeline=True,
                          bind_rank_cpus=args.bind_rank_cpus)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    start_load = time.perf_counter()
    with Engine(folder, config) as engine:
        load_s = time.perf_counter() - start_load
        warm = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 4
        engine.generate(workload.prompts[:4], warm)
        base = engine.stats()
        engine.timeline.clear()
        start = time.perf_counter()
        outputs = engine.generate(workload.prompts, params)
        wall = time.perf_counter() - start
        stats = engine.stats()
        timeline = list(engine.timeline)
    tokens = sum(o.num_generated_tokens for o in outputs)
    result = {"ranks": ranks, "wall_s": wall, "load_s": load_s, "tokens_per_s": tokens / wall,
              "num_output_tokens": tokens, "num_steps": stats.num_forwards - base.num_forwards,
              "outputs": [o.token_ids for o in outputs]}
    if ranks == 1:
        result["per_rank"] = [{"rank": 0, "expert_weight_bytes": stats.expert_weight_bytes,
                               "peak_rss_bytes": peak_rss_bytes(),
                               "busy_s": stats.busy_s - base.busy_s, "comm_s": 0.0, "idle_steps": 0}]
        result["comm_share"] = result["wait_share"] = result["exchange_share"] = result["idle_steps_share"] = 0.0
        return result
    before = {r.rank: r for r in base.ranks}
    per_rank = []
    for r in stats.ranks:
        b = before[r.rank]
        per_rank.append({"rank": r.rank, "expert_weight_bytes": r.expert_weight_bytes, "peak_rss_bytes": r.peak_rss_bytes,
                         "busy_s": r.busy_s - b.busy_s, "comm_s": r.expert_comm_s - b.expert_comm_s,
                         "idle_steps": r.num_idle_forwards - b.num_idle_forwards,
                         "generated_tokens": r.num_generated_tokens - b.num_generated_tokens,
                         "migrated_out": r.num_migrated_out - b.num_migrated_out})
    # A rank's time inside the collectives is its wait for the last rank to arrive (the other
    # ranks' attention or expert work took longer: load imbalance) plus the exchange itself,
    # from the (arrived, left) of every collective on every rank (one wall clock on the node).
    for p in per_rank:
        p["wait_s"] = sum(step["rank_wait_s"][p["rank"]] for step in timeline)
        p["exchange_s"] = sum(step["rank_exchange_s"][p["rank"]] for step in timeline)
    result["per_rank"] = per_rank
    busy = sum(p["busy_s"] for p in per_rank)
    result["comm_share"] = sum(p["comm_s"] for p in per_rank) / busy
    result["wait_share"] = sum(p["wait_s"] for p in per_rank) / busy
    result["exchange_share"] = sum(p["exchange_s"] for p in per_rank) / busy
    result["idle_steps_share"] = sum(p["idle_steps"] for p in per_rank) / (len(per_rank) * len(timeline))
    return result


def _ranks(text: str) -> int | list[str]:
    """``--ranks``: an expert-parallel size, or which ways of starting ranks to compare."""
    if text.isdigit():
        return int(text)
    names = text.split(",")
    if not names or any(n not in ("ray", "local") for n in names):
        raise argparse.ArgumentTypeError(f"--ranks takes an int or ray, local, ray,local; got {text!r}")
    return names


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=_ranks, default=2,
                        help="an int: the expert-parallel size compared with 1; 'ray', 'local' or 'ray,local': "
                             "how --size ranks start, compared (benchmarks/rank_placement.py)")
    parser.add_argument("--size", type=int, default=2, help="with --ranks ray|local: the expert-parallel size")
    parser.add_argument("--reps", type=int, default=3, help="with --ranks ray|local: repetitions (median)")
    parser.add_argument("--arch", choices=sorted(BENCH_MODELS), default="mixtral")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--p95-output", type=int, default=64)
    parser.add_argument("--median-prompt", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--attention-batch-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--expert-backend", default="native", help="the single-rank run's backend")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-bind-rank-cpus", dest="bind_rank_cpus", action="store_false",
                        help="leave the ranks unbound (EngineConfig.bind_rank_cpus=False)")
    parser.add_argument("--out", type=Path, default=Path("runs/expert-parallel"))
    args = parser.parse_args(argv)
    cache = Path(os.environ.get("BATCHGEN_DATA_CACHE", Path.home() / ".cache" / "batchgen-data"))
    folder = cache / BENCH_MODELS[args.arch][0]
    build_bench_model(folder, arch=args.arch)
    mcfg = ModelConfig.from_pretrained(folder)
    workload = make_workload(args.requests, args.p95_output, args.median_prompt, mcfg.vocab_size)
    lens = workload.output_lens
    print(f"model: {mcfg.num_params / 1e6:.0f} M params, {mcfg.num_experts} experts x "
          f"{sum(mcfg.is_sparse_layer(i) for i in range(mcfg.num_hidden_layers))} MoE layers; {args.requests} requests, "
          f"output tokens {sum(lens)} (P50 {percentile(lens, .5):.0f}, P95 {percentile(lens, .95):.0f}, max {max(lens)})",
          flush=True)
    if isinstance(args.ranks, list):
        from benchmarks.rank_placement import compare

        return compare(folder, workload, args, args.ranks)
    dtype_bytes = 2 if args.dtype in ("bfloat16", "float16") or (args.dtype == "auto" and args.device != "cpu") else 4
    model_experts = expert_weight_bytes(mcfg, dtype_bytes)
    results = [run(folder, workload, 1, args), run(folder, workload, args.ranks, args)]
    single, split = results
    identical = sum(a == b for a, b in zip(single["outputs"], split["outputs"]))
    print(f"\n{'ranks':>5}{'tok/s':>10}{'wall s':>9}{'in collectives':>16}{'= waiting':>11}{'+ exchange':>12}{'idle steps':>12}")
    for r in results:
        print(f"{r['ranks']:>5}{r['tokens_per_s']:>10.1f}{r['wall_s']:>9.1f}{100 * r['comm_share']:>15.1f}%"
              f"{100 * r['wait_share']:>10.1f}%{100 * r['exchange_share']:>11.1f}%{100 * r['idle_steps_share']:>11.1f}%")
    print(f"\nmodel's routed-expert weights: {model_experts / 2**20:.1f} MiB; per rank at N={args.ranks}:")
    for p in split["per_rank"]:
        print(f"  rank {p['rank']}: experts {p['expert_weight_bytes'] / 2**20:.1f} MiB "
              f"({p['expert_weight_bytes'] / model_experts:.3f} of the model), peak RSS {p['peak_rss_bytes'] / 2**20:.0f} MiB, "
              f"in collectives {p['comm_s']:.1f} of {p['busy_s']:.1f} s (waiting {p['wait_s']:.1f}, exchanging "
              f"{p['exchange_s']:.1f}), {p['idle_steps']} idle steps, "
              f"{p['generated_tokens']} tokens, {p['migrated_out']} migrated out")
    print(f"greedy outputs identical at 1 and {args.ranks} ranks: {identical}/{len(lens)}")
    summary = {
        "identical_outputs": identical,
        "num_requests": len(lens),
        "model_expert_weight_bytes": model_experts,
        "max_rank_expert_fraction": max(p["expert_weight_bytes"] for p in split["per_rank"]) / model_experts,
        "comm_share": split["comm_share"],
        "wait_share": split["wait_share"],
        "exchange_share": split["exchange_share"],
        "speed_ratio": split["tokens_per_s"] / single["tokens_per_s"],
        "targets": {"identical": identical == len(lens),
                    "expert_fraction": max(p["expert_weight_bytes"] for p in split["per_rank"]) / model_experts
                    <= 1 / args.ranks + 0.05,
                    "all_to_all_exchange": split["exchange_share"] <= 0.15,
                    "in_collectives_incl_waiting": split["comm_share"] <= 0.15},
    }
    print(f"targets: {summary['targets']}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in results]}
    (args.out / "expert_parallel.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'expert_parallel.json'}")
    return report


if __name__ == "__main__":
    main()
