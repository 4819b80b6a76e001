"""What logprobs cost: the same decode with and without ``logprobs=k``, in one run.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/logprobs.py   # ~1 min

On the demo model (152k vocabulary), ``--rows`` rows x ``--max-tokens`` greedy tokens, ``--reps``
alternating repetitions of: no logprobs and ``logprobs`` = 0 (the generated token only), 1, 5 and
20; the min / median / max ratio of time per output token against no logprobs (target: k <= 5
costs at most 5% at batch 64); and the same rows' prefill (one token out) with and without
``prompt_logprobs=5`` (target: at most 1.15x), prefix caching off for both (a request with
prompt logprobs computes every prompt position, as in vLLM: a cached baseline would not). Also the
capture itself on one [rows, V] logits matrix. Writes ``logprobs-cpu.json`` under ``--out``
(default ``docs/results``).

``--model mixtral_deep``: the same on a generated 32-layer Mixtral-shaped model (``benchmarks/
workload.py``, ~610 M parameters, built once into the cache, ~1 min) whose LM head is 9% of a
token's FLOPs as in real MoE models, where the demo's is 92% and bounds prompt_logprobs at ~7x;
its prompts are ``--prompt-tokens`` random token ids. ``--prefill-only`` skips the decode runs
(with the deep model they take minutes). Writes ``logprobs-<model>-cpu.json``.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/logprobs.py --model mixtral_deep --prefill-only   # ~3 min
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.engine.sample.logprob_capture import token_logprobs  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.paths import cache_dir  # noqa: E402
from benchmarks.workload import BENCH_MODELS, build_bench_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--model", choices=("demo", "mixtral_deep"), default="demo")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length with a generated model")
    parser.add_argument("--prefill-only", action="store_true", help="only prompt_logprobs against prefill")
    args = parser.parse_args()
    if args.model == "demo":
        engine = Engine("demo", EngineConfig(max_num_seqs=args.rows, enable_prefix_caching=False))
        prompts = [f"Row {i}: label this review, number {i * 7919 % 1000}" for i in range(args.rows)]
        mean_tokens = statistics.mean(len(engine.tokenizer.encode(p)) for p in prompts)
    else:
        folder = cache_dir() / BENCH_MODELS[args.model][0]
        build_bench_model(folder, arch=args.model)
        engine = Engine(folder, EngineConfig(max_num_seqs=args.rows, enable_prefix_caching=False))
        rng = random.Random(0)
        vocab = BENCH_MODELS[args.model][1]["vocab_size"]
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
        mean_tokens = args.prompt_tokens
    runs = {} if args.prefill_only else {
        name: SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=k)
        for name, k in (("none", None), ("k0", 0), ("k1", 1), ("k5", 5), ("k20", 20))}
    # Prefill only (one token out): the prompt positions' logprobs against the same rows' prefill.
    prefill = {name: SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=k)
               for name, k in (("prefill", None), ("prompt5", 5))}
    for params in runs.values():
        engine.generate(prompts[:4], params)  # warm-up
    for params in prefill.values():  # warm-up at the full size: the GEMMs at these row counts
        engine.generate(prompts, params)
    per_token: dict[str, list[float]] = {name: [] for name in runs}
    prefill_s: dict[str, list[float]] = {name: [] for name in prefill}
    for rep in range(args.reps):
        for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            outs = engine.generate(prompts, runs[name])
            per_token[name].append(1e3 * (time.perf_counter() - start) / sum(o.num_generated_tokens for o in outs))
        for name in (list(prefill) if rep % 2 == 0 else list(reversed(prefill))):
            start = time.perf_counter()
            engine.generate(prompts, prefill[name])
            prefill_s[name].append(time.perf_counter() - start)
    config = engine.executor.model.config
    vocab = config.vocab_size
    # prompt_logprobs' floor: the LM head at every prompt position instead of the last alone
    # (2 FLOPs a parameter; attention's context terms left out, small at these lengths).
    head = config.vocab_size * config.hidden_size
    body = config.active_params_per_token - head
    flop_floor = (body + head) * mean_tokens / (body * mean_tokens + head)
    source = 4 * torch.randn(args.rows, vocab)
    tokens = source.argmax(-1)
    logits = source.clone()
    times = []
    for _ in range(11):
        logits.copy_(source)  # the sampler hands over rows it is done with (overwritten in place)
        start = time.perf_counter()
        token_logprobs(logits, tokens, [5] * args.rows, overwrite=True)
        times.append(time.perf_counter() - start)
    capture_ms = 1e3 * statistics.median(times[1:])
    engine.close()

    def spread(ratios: list[float]) -> dict:
        return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}

    result = {"model": args.model, "prompt_tokens": mean_tokens, "rows": args.rows, "max_tokens": args.max_tokens,
              "reps": args.reps, "cpu": cpu_model(),
              "ms_per_token": per_token, "prefill_s": prefill_s, "capture_ms_k5": capture_ms,
              "ratio": {name: spread([v / b for v, b in zip(per_token[name], per_token["none"])])
                        for name in runs if name != "none"} if runs else {},
              "prompt_logprobs_ratio": spread([v / b for v, b in zip(prefill_s["prompt5"], prefill_s["prefill"])]),
              "prompt_logprobs_flop_floor": flop_floor, "head_share_of_token_flops": head / config.active_params_per_token}
    args.out.mkdir(parents=True, exist_ok=True)
    out_name = "logprobs-cpu.json" if args.model == "demo" else f"logprobs-{args.model.replace('_', '-')}-cpu.json"
    (args.out / out_name).write_text(json.dumps(result, indent=2))
    print(f"{args.model}: {args.rows} rows x {args.max_tokens} tokens, {args.reps} alternating reps on {cpu_model()}; "
          "ratio per output token against no logprobs, min / median / max:")
    for name in runs:
        r = result["ratio"].get(name)
        print(f"  {name:5s} {statistics.median(per_token[name]):.3f} ms/token"
              + (f"  {r['min']:.3f} / {r['median']:.3f} / {r['max']:.3f}x" if r else ""))
    r = result["prompt_logprobs_ratio"]
    print(f"  prompt_logprobs=5 against the same rows' prefill: {r['min']:.3f} / {r['median']:.3f} / {r['max']:.3f}x"
          f" (FLOP floor {flop_floor:.2f}x: the LM head is {100 * head / config.active_params_per_token:.0f}% of a"
          f" token's FLOPs, and it runs at all {mean_tokens:.1f} prompt positions instead of the last)")
    print(f"  capture alone (k=5, {args.rows} rows): {capture_ms:.2f} ms per step")


if __name__ == "__main__":
    main()
