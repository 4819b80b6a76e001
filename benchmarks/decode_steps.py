"""Decode steps against running-set size, beside the memory roofline and llama.cpp (issue #35).

    .venv/bin/python benchmarks/decode_steps.py                 # the engine and the roofline, ~1 min
    .venv/bin/python benchmarks/decode_steps.py --llama-cpp     # + llama.cpp on the same weights
    .venv/bin/python benchmarks/decode_steps.py --profile       # + where a step's time goes
    .venv/bin/python benchmarks/decode_steps.py --torch-baseline  # + torch's kernels only, same run

The model is ``mixtral_decode`` (``benchmarks/workload.py``): 4 layers, 16 experts (top-2), a
vocabulary of 8,192, fp32. For every running-set size N the engine takes N rows of
``--prompt-tokens`` random tokens, each generating exactly ``--gen-tokens`` (greedy,
``ignore_eos``), the shape of ``llama-batched-bench -npp P -ntg G -npl N``. Decode tok/s counts
the steps where all N rows decode (N tokens each); prefill tok/s the steps that carry prompt
tokens. The roofline of a step is ``benchmarks.roofline.step_floor_seconds`` of that very step
(its weights, the experts it ran and the KV it read, over the measured streaming bandwidth).
llama.cpp runs from the build ``benchmarks/llama_cpp.py`` makes once in the cache, with f32
weights and f32 KV, flash attention off (its exact mode), and its default f16 KV for reference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.model import ModelConfig  # noqa: E402
from batchgen_data.paths import cache_dir  # noqa: E402
from benchmarks.roofline import measure_matmul_rates, measure_memory_bandwidth, step_floor_seconds  # noqa: E402
from benchmarks.workload import BENCH_MODELS, build_bench_model, output_length_quantile  # noqa: E402

MODEL = "mixtral_decode"


@dataclass(slots=True)
class DecodeRow:
    """The engine at one running-set size."""

    running: int
    num_decode_steps: int  # steps where all N rows decoded
    decode_tokens_per_s: float
    step_ms_median: float
    step_ms_min: float
    roofline_ms: float  # the median decode step's floor (bandwidth or FLOPs, whichever binds)
    prefill_tokens_per_s: float
    # Median seconds per decode step by module group (the runner's own timers) and the rest:
    # scheduling, metadata, sampling bookkeeping, publishing progress.
    module_ms: dict[str, float] = field(default_factory=dict)

    @property
    def over_roofline(self) -> float:
        return self.step_ms_median / self.roofline_ms


def ensure_model() -> Path:
    folder = cache_dir() / BENCH_MODELS[MODEL][0]
    if not (folder / "config.json").is_file():
        build_bench_model(folder, arch=MODEL)
    return folder


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def measure_engine(engine: Engine, mcfg: ModelConfig, running: int, prompt_tokens: int, gen_tokens: int,
                   bandwidth_gbs: float, gflops: float, seed: int = 0) -> DecodeRow:
    """N rows of exactly ``gen_tokens`` each through a warm engine; the decode and prefill rates."""
    params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    engine.timeline.clear()
    engine.generate(_prompts(running, prompt_tokens, mcfg.vocab_size, seed), params)
    steps = engine.timeline
    decode = [s for s in steps if s["num_tokens"] == running and s["num_sampled"] == running]
    prefill = [s for s in steps if s["num_tokens"] > s["num_sampled"]]
    if not decode:
        raise RuntimeError(f"no step decoded all {running} rows at once: raise max_num_seqs")
    times = [s["step_s"] for s in decode]
    median = statistics.median(times)
    floors = sorted(step_floor_seconds(s, mcfg, gflops, bandwidth_gbs) for s in decode)
    modules = {}
    for name in ("attention", "moe", "logits"):
        modules[name] = 1e3 * statistics.median(s[f"{name}_s"] for s in decode)
    modules["other"] = max(0.0, 1e3 * median - sum(modules.values()))
    prefill_tokens = sum(s["num_tokens"] - s["num_sampled"] for s in prefill)
    return DecodeRow(
        running=running,
        num_decode_steps=len(decode),
        decode_tokens_per_s=running * len(decode) / sum(times),
        step_ms_median=1e3 * median,
        step_ms_min=1e3 * min(times),
        roofline_ms=1e3 * floors[len(floors) // 2],
        prefill_tokens_per_s=prefill_tokens / sum(s["step_s"] for s in prefill) if prefill else 0.0,
        module_ms=modules,
    )


def skewed_lengths(num_rows: int = 64, shortest: int = 4, longest: int = 240) -> list[int]:
    """Output lengths of a skewed job: the throughput benchmark's trace shape (lognormal body,
    P99 = 3.8 x P95, max = 9 x P95) scaled to [shortest, longest], in a fixed shuffled order."""
    raw = [output_length_quantile((i + 0.5) / num_rows, 100) for i in range(num_rows)]
    low, high = min(raw), max(raw)
    lengths = [round(shortest + (r - low) / (high - low) * (longest - shortest)) for r in raw]
    random.Random(0).shuffle(lengths)
    return lengths


def measure_skewed_job(engine: Engine, mcfg: ModelConfig, lengths: list[int], prompt_tokens: int) -> dict:
    """Wall seconds of one job of ``len(lengths)`` rows, each generating exactly its length."""
    prompts = _prompts(len(lengths), prompt_tokens, mcfg.vocab_size, seed=7)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    assert [o.num_generated_tokens for o in outputs] == lengths
    return {"wall_s": wall, "output_tokens": sum(lengths), "tokens_per_s": sum(lengths) / wall}


def llama_cpp_job_estimate(rows: list[dict], lengths: list[int], prompt_tokens: int) -> dict:
    """llama.cpp's time for the same job from its measured rates, as a server with continuous
    batching would run it: the prompts prefilled at its rate for that many sequences, then one
    decode step per token position with every row not yet finished, each step taking its
    measured step time at that running-set size (linear between the sizes measured). An
    estimate, not a measurement: ``llama-batched-bench`` generates equal lengths only."""
    by_size = sorted((r["running"], r["step_ms"]) for r in rows)
    prefill_rate = min(by_size, key=lambda item: abs(item[0] - len(lengths)))[0]
    prefill_rate = next(r["prefill_tokens_per_s"] for r in rows if r["running"] == prefill_rate)

    def step_ms(n: int) -> float:
        for (n0, t0), (n1, t1) in zip(by_size, by_size[1:]):
            if n0 <= n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return by_size[-1][1] * n / by_size[-1][0] if n > by_size[-1][0] else by_size[0][1]

    decode_s = sum(step_ms(sum(1 for n in lengths if n > t)) for t in range(1, max(lengths))) / 1e3
    prefill_s = len(lengths) * prompt_tokens / prefill_rate
    return {"wall_s": prefill_s + decode_s, "prefill_s": prefill_s, "decode_s": decode_s}


def profile_ops(engine: Engine, mcfg: ModelConfig, running: int, prompt_tokens: int, steps: int = 40) -> dict:
    """Where the time of ``steps`` decode steps at N running goes: GEMM kernels, the other torch
    ops (self time) and the rest (Python, dispatch, bookkeeping), per step in ms; and the ten
    costliest non-GEMM ops."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True)
    for prompt in _prompts(running, prompt_tokens, mcfg.vocab_size, seed=1):
        engine.add_request(prompt, params)
    engine.step()
    while _prefilling(engine):
        engine.step()
    for _ in range(5):  # warm
        engine.step()
    with _native_kernels_named(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    gemm, native, ops, top = 0.0, 0.0, 0.0, []
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total
        if event.key.startswith("native::"):
            native += self_us
        elif any(k in event.key for k in ("linear", "::mm", "addmm", "bmm", "matmul")):
            gemm += self_us
        else:
            ops += self_us
            top.append((self_us, event.key, event.count))
    top.sort(reverse=True)
    per_step = 1e-3 / steps
    return {
        "running": running,
        "step_ms_profiled": 1e3 * wall / steps,
        "gemm_ms": gemm * per_step,
        "native_ms": native * per_step,
        "other_ops_ms": ops * per_step,
        "python_and_dispatch_ms": max(0.0, 1e3 * wall / steps - (gemm + native + ops) * per_step),
        "ops_per_step": sum(e.count for e in prof.key_averages()) / steps,
        "top_other_ops": [{"op": k, "ms_per_step": us * per_step, "calls_per_step": c / steps}
                          for us, k, c in top[:10]],
    }


@contextlib.contextmanager
def _native_kernels_named():
    """The compiled kernels under ``native::<name>`` in the profiler (they are not aten ops)."""
    from torch.profiler import record_function

    from batchgen_data.model import layers
    from batchgen_data.model.native import load_native

    module = load_native()
    if module is None:
        yield
        return

    def named(name, fn):
        def call(*args):
            with record_function(f"native::{name}"):
                return fn(*args)
        return call

    names = ("skinny_linear", "swiglu_experts", "paged_decode_attention")
    saved = {name: getattr(module, name) for name in names}
    saved_kernel = layers._KERNELS.get("skinny")
    try:
        for name in names:
            setattr(module, name, named(name, saved[name]))
        if saved_kernel is not None:
            layers._KERNELS["skinny"] = named("skinny_linear", saved_kernel)
        yield
    finally:
        for name in names:
            setattr(module, name, saved[name])
        if saved_kernel is not None:
            layers._KERNELS["skinny"] = saved_kernel


def _prefilling(engine: Engine) -> bool:
    report = engine.last_report
    return report is not None and report.num_tokens > report.num_sampled


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,2,4,8,16,32,64", help="running-set sizes, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--profile", action="store_true", help="torch profiler breakdown at every size")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="llama.cpp side by side (built once into the cache: minutes the first time)")
    parser.add_argument("--torch-baseline", action="store_true",
                        help="first run the engine with torch's kernels only (BATCHGEN_DATA_NATIVE_KERNELS=0, a "
                             "child process) for a same-run before/after")
    parser.add_argument("--skewed-job", action="store_true",
                        help="also time one job of max(--running) rows with skewed outputs (4-240 tokens); with "
                             "--llama-cpp, beside llama.cpp's time estimated from its measured step times")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every system in turn; medians and paired ratios over them")
    parser.add_argument("--out", type=Path, default=Path("runs/decode_steps"))
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.running.split(",")]
    torch.set_num_threads(args.threads)
    folder = ensure_model()
    mcfg = ModelConfig.from_pretrained(folder)
    bandwidth = measure_memory_bandwidth()
    gflops = max(measure_matmul_rates(mcfg.hidden_size, mcfg.moe_intermediate_size, seconds=0.5).values())
    print(f"{cpu_model()}, {args.threads} threads; streaming read {bandwidth:.1f} GB/s, best GEMM {gflops:.0f} GFLOP/s",
          flush=True)
    engine = Engine(folder, EngineConfig(max_num_seqs=max(sizes), max_num_batched_tokens=max(2048, args.prompt_tokens),
                                         collect_timeline=True))
    engine.generate(_prompts(4, 16, mcfg.vocab_size, seed=9), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    # Rounds, each running every system once in turn: this machine's memory bandwidth drifts by
    # tens of percent over minutes, so only ratios within a round compare like with like.
    rounds = []
    for r in range(args.repeats):
        this = {"torch_kernels": _torch_baseline(args, r)["engine"] if args.torch_baseline else []}
        this["engine"] = [dict(asdict(row), over_roofline=row.over_roofline)
                          for row in (measure_engine(engine, mcfg, n, args.prompt_tokens, args.gen_tokens, bandwidth,
                                                     gflops, seed=r) for n in sizes)]
        if args.skewed_job:
            this["skewed_job"] = measure_skewed_job(engine, mcfg, skewed_lengths(max(sizes)), args.prompt_tokens)
        if args.llama_cpp:
            from benchmarks.llama_cpp import llama_cpp_side_by_side

            this["llama_cpp"] = llama_cpp_side_by_side(folder, sizes, args.prompt_tokens, args.gen_tokens,
                                                       args.threads)
            if args.skewed_job:
                estimate = llama_cpp_job_estimate(this["llama_cpp"]["f32"], skewed_lengths(max(sizes)),
                                                  args.prompt_tokens)
                this["skewed_job"]["llama_cpp_f32_estimate"] = estimate
                this["skewed_job"]["ours_over_llama_cpp"] = estimate["wall_s"] / this["skewed_job"]["wall_s"]
        rounds.append(this)
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    profiles = [profile_ops(engine, mcfg, n, args.prompt_tokens) for n in sizes] if args.profile else []
    engine.close()
    result = {
        "cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
        "bandwidth_gbs": bandwidth, "gemm_gflops": gflops,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
        **summarize(rounds), "profile": profiles, "rounds": rounds,
    }
    print(format_table(result))
    jobs = [r["skewed_job"] for r in rounds if "skewed_job" in r]
    if jobs:
        line = f"skewed job ({max(sizes)} rows, outputs 4-240): {statistics.median(j['wall_s'] for j in jobs):.2f} s"
        if "ours_over_llama_cpp" in jobs[0]:
            line += (f"; llama.cpp estimated {statistics.median(j['llama_cpp_f32_estimate']['wall_s'] for j in jobs):.2f} s"
                     f"; ours / llama.cpp {statistics.median(j['ours_over_llama_cpp'] for j in jobs):.2f}x "
                     "(median of rounds)")
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_steps.json").write_text(json.dumps(result, indent=2))
    return result


def summarize(rounds: list[dict]) -> dict:
    """Per running-set size, the round with the median decode rate of each system, and the median
    over rounds of each same-round ratio to ours (``ours_over``: system -> {size: ratio})."""
    def by_size(rows: list[dict]) -> dict[int, dict]:
        return {row["running"]: row for row in rows}

    def median_rows(per_round: list[list[dict]]) -> list[dict]:
        sizes = sorted({row["running"] for rows in per_round for row in rows})
        out = []
        for n in sizes:
            rows = sorted((by_size(rows)[n] for rows in per_round if n in by_size(rows)),
                          key=lambda row: row["decode_tokens_per_s"])
            out.append(rows[(len(rows) - 1) // 2])
        return out

    def ratios(others: list[list[dict]]) -> dict[int, float]:
        found: dict[int, list[float]] = {}
        for ours, theirs in zip((r["engine"] for r in rounds), others):
            theirs_n = by_size(theirs)
            for row in ours:
                if row["running"] in theirs_n:
                    found.setdefault(row["running"], []).append(
                        row["decode_tokens_per_s"] / theirs_n[row["running"]]["decode_tokens_per_s"])
        return {n: statistics.median(v) for n, v in found.items()}

    summary = {"engine": median_rows([r["engine"] for r in rounds]), "ours_over": {}}
    if rounds and rounds[0].get("torch_kernels"):
        summary["torch_kernels"] = median_rows([r["torch_kernels"] for r in rounds])
        summary["ours_over"]["torch_kernels"] = ratios([r["torch_kernels"] for r in rounds])
    summary["llama_cpp"] = {}
    for kv in (rounds[0].get("llama_cpp") or {}) if rounds else {}:
        summary["llama_cpp"][kv] = median_rows([r["llama_cpp"][kv] for r in rounds])
        summary["ours_over"][f"llama_cpp_{kv}"] = ratios([r["llama_cpp"][kv] for r in rounds])
    return summary


def _torch_baseline(args, round_index: int) -> dict:
    """This benchmark's engine rows with torch's kernels only, from a child process."""
    import os
    import subprocess

    out = args.out / f"torch-kernels-{round_index}"
    env = dict(os.environ, BATCHGEN_DATA_NATIVE_KERNELS="0")
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--running", args.running,
                    "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
                    "--threads", str(args.threads), "--out", str(out)], env=env, check=True)
    return json.loads((out / "decode_steps.json").read_text())


def format_table(result: dict) -> str:
    """Markdown: step time and tok/s against N, beside the roofline and llama.cpp."""
    llama = {kv: {r["running"]: r for r in rows} for kv, rows in result.get("llama_cpp", {}).items()}
    torch_rows = {r["running"]: r for r in result.get("torch_kernels", [])}
    over = result.get("ours_over", {})
    head = "| running | step ms | roofline ms | step / roofline | decode tok/s | prefill tok/s |"
    rule = "|---:|---:|---:|---:|---:|---:|"
    if torch_rows:
        head += " torch kernels: decode tok/s | native / torch |"
        rule += "---:|---:|"
    for kv in llama:
        head += f" llama.cpp decode tok/s ({kv} KV) | ours / llama.cpp ({kv}) |"
        rule += "---:|---:|"
    head += " attention / moe / logits / other ms |"
    rule += "---|"
    lines = [head, rule]
    for r in result["engine"]:
        m = r["module_ms"]
        line = (f"| {r['running']} | {r['step_ms_median']:.2f} | {r['roofline_ms']:.2f} | {r['over_roofline']:.2f} "
                f"| {r['decode_tokens_per_s']:.0f} | {r['prefill_tokens_per_s']:.0f} |")
        if torch_rows:
            before = torch_rows.get(r["running"])
            ratio = over.get("torch_kernels", {}).get(r["running"])
            line += f" {before['decode_tokens_per_s']:.0f} | {ratio:.2f} |" if before and ratio else " - | - |"
        for kv in llama:
            theirs = llama[kv].get(r["running"])
            ratio = over.get(f"llama_cpp_{kv}", {}).get(r["running"])
            line += f" {theirs['decode_tokens_per_s']:.0f} | {ratio:.2f} |" if theirs and ratio else " - | - |"
        line += f" {m['attention']:.2f} / {m['moe']:.2f} / {m['logits']:.2f} / {m['other']:.2f} |"
        lines.append(line)
    for p in result.get("profile", []):
        lines.append(f"\nN={p['running']}: {p['step_ms_profiled']:.2f} ms/step profiled = torch GEMMs {p['gemm_ms']:.2f} "
                     f"+ native kernels {p['native_ms']:.2f} + other torch ops {p['other_ops_ms']:.2f} "
                     f"+ Python/dispatch {p['python_and_dispatch_ms']:.2f} ({p['ops_per_step']:.0f} ops/step)")
        for op in p["top_other_ops"][:6]:
            lines.append(f"    {op['op']}: {op['ms_per_step']:.3f} ms, {op['calls_per_step']:.0f} calls")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
