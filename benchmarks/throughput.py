"""Throughput benchmark: batchgen-data vs transformers static and continuous batching.

One command, same prompts and output lengths for every system, in the same run:

    .venv/bin/python benchmarks/throughput.py            # CPU, ~10 min
    .venv/bin/python benchmarks/throughput.py --quick    # smaller workload, ~3 min

Prints a table, writes ``throughput.json`` and ``throughput_timeline.png`` under ``--out``.
The workload is skewed as in the BatchGen paper's trace (prompt lengths lognormal; output lengths
with P99 = 3.8 x P95 and max = 9 x P95, fixed with ``max_tokens`` and ``ignore_eos``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.model import ModelConfig  # noqa: E402
from benchmarks.hf_baselines import BaselineResult, run_continuous, run_static  # noqa: E402
from benchmarks.roofline import (  # noqa: E402
    decode_flops_per_token,
    measure_matmul_rates,
    measure_memory_bandwidth,
    step_floor_seconds,
)
from benchmarks.workload import BENCH_MODELS, build_bench_model, make_workload, percentile  # noqa: E402


def run_batchgen(folder: Path, workload, args) -> dict:
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        attention_batch_size=args.attention_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tune_gemms=args.tune_gemms,
        collect_timeline=True,
    )
    engine = Engine(folder, config)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    # Warm-up on a few requests so one-time costs (allocator, kernels) are not in the timing.
    engine.generate(workload.prompts[:4], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 4)
    engine.timeline.clear()
    base = engine.stats()
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    stats = engine.stats()
    t0 = engine.timeline[0]["t"] - engine.timeline[0]["step_s"]
    cumulative, timeline = 0, []
    for step in engine.timeline:
        cumulative += step["num_sampled"]
        timeline.append((step["t"] - t0, cumulative))
    steady = [
        s for s in engine.timeline
        if s["num_tokens"] == s["num_sampled"] and s["num_sampled"] >= config.refill_threshold * config.max_num_seqs
    ]
    steady_tps = sum(s["num_sampled"] for s in steady) / sum(s["step_s"] for s in steady) if steady else 0.0
    busy = stats.busy_s - base.busy_s
    kernel = stats.kernel_s - base.kernel_s
    return {
        "name": "batchgen-data",
        "wall_s": wall,
        "num_output_tokens": sum(o.num_generated_tokens for o in outputs),
        "tokens_per_s": sum(o.num_generated_tokens for o in outputs) / wall,
        "steady_decode_tokens_per_s": steady_tps,
        "num_steady_steps": len(steady),
        "mean_steady_batch": statistics.mean(s["num_sampled"] for s in steady) if steady else 0,
        "mean_tokens_per_expert_call": (stats.mean_tokens_per_expert_call),
        "runtime_overhead": 1.0 - kernel / busy if busy else 0.0,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "outputs": [o.token_ids for o in outputs],
        "timeline": timeline,
        "engine_timeline": engine.timeline,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(BENCH_MODELS), default="mixtral",
                        help="the benchmark model's family (deepseek_v3: MLA, grouped sigmoid routing)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--p95-output", type=int, default=64)
    parser.add_argument("--median-prompt", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--attention-batch-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--static-batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tune-gemms", action=argparse.BooleanOptionalAction, default=True,
                        help="measured CPU GEMM kernel choice (--no-tune-gemms: the fixed rule)")
    parser.add_argument("--hf-cb-num-blocks", type=int, default=2048, help="transformers CB KV blocks (16 tokens)")
    parser.add_argument("--hf-cb-max-batch-tokens", type=int, default=512)
    parser.add_argument("--skip-continuous", action="store_true", help="skip transformers continuous batching")
    parser.add_argument("--quick", action="store_true", help="256 requests (for a fast look)")
    parser.add_argument("--out", type=Path, default=Path("runs/throughput"))
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 256
    torch.manual_seed(0)
    cache = Path(os.environ.get("BATCHGEN_DATA_CACHE", Path.home() / ".cache" / "batchgen-data"))
    folder = cache / BENCH_MODELS[args.arch][0]
    hf_model = build_bench_model(folder, arch=args.arch)
    mcfg = ModelConfig.from_pretrained(folder)
    workload = make_workload(args.requests, args.p95_output, args.median_prompt, mcfg.vocab_size)
    lens = workload.output_lens
    print(
        f"model: {mcfg.num_params / 1e6:.0f} M params ({mcfg.active_params_per_token / 1e6:.0f} M active/token), "
        f"{args.requests} requests, output tokens {sum(lens)} (P50 {percentile(lens, .5):.0f}, "
        f"P95 {percentile(lens, .95):.0f}, P99 {percentile(lens, .99):.0f}, max {max(lens)})",
        flush=True,
    )

    results: dict[str, dict] = {}
    ours = run_batchgen(folder, workload, args)
    results["batchgen-data"] = ours
    print(f"batchgen-data: {ours['tokens_per_s']:.1f} tok/s in {ours['wall_s']:.1f}s", flush=True)
    if args.device == "cpu":
        hf_model = hf_model.to(torch.float32)
    else:
        hf_model = hf_model.to(args.device, torch.bfloat16 if args.dtype in ("auto", "bfloat16") else torch.float32)
    baselines: list[BaselineResult] = [
        run_static(hf_model, workload.prompts, lens, batch_size=args.static_batch_size, sort_by_length=True)
    ]
    print(f"{baselines[-1].name}: {baselines[-1].tokens_per_s:.1f} tok/s in {baselines[-1].wall_s:.1f}s", flush=True)
    if not args.skip_continuous:
        # Bounded memory: transformers' CB defaults take about half the RAM.
        try:
            baselines.append(
                run_continuous(hf_model, workload.prompts, lens, num_blocks=args.hf_cb_num_blocks,
                               max_batch_tokens=args.hf_cb_max_batch_tokens, block_size=16)
            )
            print(f"{baselines[-1].name}: {baselines[-1].tokens_per_s:.1f} tok/s in {baselines[-1].wall_s:.1f}s", flush=True)
        except Exception as err:  # not every architecture runs under transformers' CB
            print(f"hf-continuous: not runnable for {args.arch}: {type(err).__name__}: {err}", flush=True)
    for b in baselines:
        results[b.name] = {
            "name": b.name, "wall_s": b.wall_s, "num_output_tokens": b.num_output_tokens,
            "tokens_per_s": b.tokens_per_s, "outputs": b.output_token_ids, "timeline": b.timeline,
        }

    # Correctness guard: every system produced the same greedy tokens (fp32 on CPU).
    for b in baselines:
        same = sum(o == r for o, r in zip(ours["outputs"], b.output_token_ids))
        results[b.name]["num_outputs_identical_to_batchgen"] = same

    rates = measure_matmul_rates(mcfg.hidden_size, mcfg.moe_intermediate_size, device=args.device)
    gflops = max(rates.values())  # the best kernel on the experts' shapes: the machine's ceiling
    mean_ctx = statistics.mean(len(p) for p in workload.prompts) + statistics.mean(lens) / 2
    roofline_tps = gflops * 1e9 / decode_flops_per_token(mcfg, int(mean_ctx))
    bandwidth = measure_memory_bandwidth(device=args.device)
    for step in ours["engine_timeline"]:
        step["floor_s"] = step_floor_seconds(step, mcfg, gflops, bandwidth)
    ours["phases"] = _phase_summary(ours["engine_timeline"])
    floor_s = sum(step["floor_s"] for step in ours["engine_timeline"])
    best = max(baselines, key=lambda b: b.tokens_per_s)
    three_x_completion_s = ours["num_output_tokens"] / (3 * best.tokens_per_s)
    summary = {
        "speedup_vs_best_baseline": ours["tokens_per_s"] / best.tokens_per_s,
        "best_baseline": best.name,
        "matmul_gflops": gflops,
        "matmul_gflops_by_kernel": rates,
        "memory_bandwidth_gbs": bandwidth,
        "roofline_tokens_per_s": roofline_tps,
        "steady_decode_fraction_of_roofline": ours["steady_decode_tokens_per_s"] / roofline_tps,
        "runtime_overhead": ours["runtime_overhead"],
        "mean_tokens_per_expert_call": ours["mean_tokens_per_expert_call"],
        # What the target leaves against what the MoE blocks and the lm_head took in this run.
        "three_x_completion_s": three_x_completion_s,
        "moe_and_logits_s": sum(p["moe_s"] + p["logits_s"] for p in ours["phases"]),
        # This run's steps, each at the machine's roofline (FLOPs at the peak rate or bytes at
        # the bandwidth), and the share of that roofline the whole run must reach for 3x.
        "roofline_completion_s": floor_s,
        "three_x_needs_fraction_of_roofline": floor_s / three_x_completion_s,
        "run_fraction_of_roofline": floor_s / ours["wall_s"],
    }
    _print_table(results, summary)
    print(f"KV cache: {ours['kv_bytes_per_token']} bytes per token (all layers); per-head K and V would take "
          f"{_expanded_kv_bytes(mcfg)}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "model_params": mcfg.num_params,
        "arch": args.arch,
        "kv_bytes_per_token": ours["kv_bytes_per_token"],
        "kv_bytes_per_token_expanded": _expanded_kv_bytes(mcfg),
        "output_lengths": {"total": sum(lens), "p50": percentile(lens, .5), "p95": percentile(lens, .95),
                           "p99": percentile(lens, .99), "max": max(lens)},
        "summary": summary,
        "systems": {k: {kk: vv for kk, vv in v.items() if kk not in ("outputs", "engine_timeline")} for k, v in results.items()},
    }
    (args.out / "throughput.json").write_text(json.dumps(report, indent=2))
    _plot(results, args.out / "throughput_timeline.png")
    print(f"wrote {args.out / 'throughput.json'} and {args.out / 'throughput_timeline.png'}")
    return report


def _expanded_kv_bytes(config: ModelConfig, dtype_bytes: int = 4) -> int:
    """What per-head K and V would take per token (all layers): MLA's comparison point."""
    if config.mla is None:
        return config.kv_values_per_token * dtype_bytes
    mla = config.mla
    per_layer = config.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim)
    return per_layer * config.num_hidden_layers * dtype_bytes


# Decode phases by running-set size: where the wall time of a skewed batch goes.
_DECODE_PHASES = ((128, None), (8, 128), (1, 8))
# Module groups the engine times per step (``RunnerStats.last_module_s``).
_MODULE_GROUPS = ("attention", "moe", "logits")


def _phase_summary(timeline: list[dict]) -> list[dict]:
    """Steps, seconds and tokens of the prefill-carrying steps and of decode steps by batch size."""
    def row(name: str, steps: list[dict]) -> dict:
        seconds = sum(s["step_s"] for s in steps)
        sampled = sum(s["num_sampled"] for s in steps)
        modules = {f"{m}_s": sum(s[f"{m}_s"] for s in steps) for m in _MODULE_GROUPS}
        return {"phase": name, "steps": len(steps), "seconds": seconds, "forward_tokens": sum(s["num_tokens"] for s in steps),
                "tokens_per_s": sampled / seconds if seconds else 0.0, **modules,
                "other_s": seconds - sum(modules.values()), "roofline_s": sum(s["floor_s"] for s in steps)}

    decode = [s for s in timeline if s["num_tokens"] == s["num_sampled"]]
    rows = [row("steps with prefill chunks", [s for s in timeline if s["num_tokens"] > s["num_sampled"]])]
    for lo, hi in _DECODE_PHASES:
        name = f"decode, {lo}+ running" if hi is None else f"decode, {lo}-{hi - 1} running"
        rows.append(row(name, [s for s in decode if s["num_sampled"] >= lo and (hi is None or s["num_sampled"] < hi)]))
    return rows


def _print_table(results: dict, summary: dict) -> None:
    print()
    print(f"{'system':<28}{'tok/s':>10}{'completion s':>14}{'vs batchgen':>13}")
    ours = results["batchgen-data"]["tokens_per_s"]
    for name, r in results.items():
        print(f"{name:<28}{r['tokens_per_s']:>10.1f}{r['wall_s']:>14.1f}{r['tokens_per_s'] / ours:>13.2f}")
    print()
    print(f"speedup vs best baseline ({summary['best_baseline']}): {summary['speedup_vs_best_baseline']:.2f}x")
    print(f"steady-state decode: {results['batchgen-data']['steady_decode_tokens_per_s']:.1f} tok/s = "
          f"{100 * summary['steady_decode_fraction_of_roofline']:.0f}% of the roofline "
          f"({summary['roofline_tokens_per_s']:.0f} tok/s at {summary['matmul_gflops']:.0f} GFLOP/s, "
          f"the best of {len(summary['matmul_gflops_by_kernel'])} kernel/shape rates)")
    print(f"mean tokens per expert call: {summary['mean_tokens_per_expert_call']:.1f}")
    print(f"runtime overhead (outside model modules): {100 * summary['runtime_overhead']:.1f}%")
    print("batchgen-data phases (seconds: all = attention + MoE + lm_head/sampling + the rest; the same steps at the roofline):")
    for p in results["batchgen-data"]["phases"]:
        print(f"  {p['phase']:<28}{p['steps']:>6} steps{p['seconds']:>8.1f} s ="
              f"{p['attention_s']:>6.1f}{p['moe_s']:>6.1f}{p['logits_s']:>6.1f}{p['other_s']:>6.1f}"
              f"{p['roofline_s']:>8.1f} s at roofline{p['forward_tokens']:>8} forward tokens"
              f"{p['tokens_per_s']:>8.0f} output tok/s")
    print(f"MoE blocks and lm_head+sampling alone: {summary['moe_and_logits_s']:.1f} s; 3x the best baseline "
          f"needs a completion of {summary['three_x_completion_s']:.1f} s")
    print(f"these steps at the roofline ({summary['matmul_gflops']:.0f} GFLOP/s, "
          f"{summary['memory_bandwidth_gbs']:.1f} GB/s): {summary['roofline_completion_s']:.1f} s; the run reached "
          f"{100 * summary['run_fraction_of_roofline']:.0f}% of it, 3x needs "
          f"{100 * summary['three_x_needs_fraction_of_roofline']:.0f}%")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = results["batchgen-data"]["engine_timeline"]
    t0 = steps[0]["t"] - steps[0]["step_s"]
    ts = [s["t"] - t0 for s in steps]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(ts, [s["num_running"] for s in steps], label="running sequences")
    axes[0].set_ylabel("running sequences")
    axes[1].plot(ts, [s["tokens_per_expert_call"] for s in steps], color="tab:orange")
    axes[1].set_ylabel("tokens per expert call")
    for name, r in results.items():
        xs = [t for t, _ in r["timeline"]]
        ys = [n for _, n in r["timeline"]]
        axes[2].plot(xs, ys, label=f"{name} ({r['tokens_per_s']:.0f} tok/s)")
    axes[2].set_ylabel("output tokens (cumulative)")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    fig.suptitle("batchgen-data throughput benchmark (skewed workload)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
