"""Speculative decoding on a skewed batch job: on against off, in one run, same workload.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/speculative.py            # ~4 min
    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/speculative.py --arch deepseek_v3 --mtp

The throughput benchmark's workload (``benchmarks/workload.py``: lognormal prompts, output
lengths with P99 = 3.8 x P95, max = 9 x P95, greedy, ``ignore_eos``) on its model, run with:
  * ``off``: no speculation (the baseline, run after an untimed warm-up run and again last:
    the pair's spread is the noise; the warm-up also measures the step costs the policy uses);
  * ``oracle-k<k>``: a proposer that knows the plain run's tokens, drafting k every step (the
    upper bound of what verification gains at each running-set size);
  * ``oracle-adaptive``: the same proposer under the engine's policy (0..k per row per step);
  * ``never-right``: a proposer whose every token is wrong, under the policy (the cost of
    speculation that fails: the policy should turn it off);
  * ``ngram``: prompt lookup (vLLM's ``ngram``), under the policy;
  * ``suffix``: suffix decoding over the job's finished outputs and the row (vLLM's ``suffix``),
    under the policy;
  * with ``--mtp`` (DeepSeek-V3): the same weights plus a random MTP layer, in an engine of its
    own: ``mtp catch-up only`` (the layer keeps its KV, nothing is drafted: its cost), ``mtp``
    (under the policy) and ``mtp-k<k>`` (k drafts every step). A random layer's drafts are
    almost never right: these runs measure the cost, not the gain, of MTP drafting.
Reported per run: wall time, output tok/s, the tail (every step from the one where the running
set first falls to 7 or fewer with nothing queued), its steps and tokens per step, drafted and
accepted tokens; every run's tokens are checked equal to ``off``'s. The demo-style random-weight
models repeat tokens, so the n-gram and suffix acceptance here says nothing about real models. Writes
``speculative-<arch>-cpu.json`` and a timeline PNG of the tail under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.engine.spec.proposers import SuffixProposer, TableProposer  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.model import ModelConfig  # noqa: E402
from benchmarks.workload import BENCH_MODELS, build_bench_model, build_bench_mtp_model, make_workload  # noqa: E402

TAIL_RUNNING = 7


def run(engine: Engine, workload, name: str, proposer=None, fixed: int | None = None,
        enabled: bool | None = None) -> dict:
    drafter = engine.executor.scheduler.drafter
    drafter.proposer = proposer if proposer is not None else drafter.default_proposer
    drafter.fixed_length = fixed
    drafter.enabled = not name.startswith("off") if enabled is None else enabled
    drafter.reset_stats()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    engine.timeline.clear()
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    steps = list(engine.timeline)
    t0 = steps[0]["t"] - steps[0]["step_s"]
    tail_start = next(i for i, s in enumerate(steps) if s["num_running"] <= TAIL_RUNNING and s["num_waiting"] == 0)
    tail = steps[tail_start + 1:]  # the steps that run with at most 7 sequences
    stats = drafter.stats
    tokens = sum(o.num_generated_tokens for o in outputs)
    return {
        "name": name, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "tail_s": sum(s["step_s"] for s in tail), "tail_steps": len(tail),
        "tail_tokens_per_step": sum(s["num_sampled"] for s in tail) / max(1, len(tail)),
        "drafted": stats.num_drafted_tokens, "accepted": stats.num_accepted_tokens,
        "acceptance": stats.acceptance_rate,
        "timeline": [(s["t"] - t0, s["num_running"], s["num_sampled"]) for s in steps],
        "outputs": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(BENCH_MODELS), default="mixtral")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--p95-output", type=int, default=64)
    parser.add_argument("--median-prompt", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--mtp", action="store_true",
                        help="also the model with a random MTP layer (deepseek_v3): its catch-up alone, "
                             "under the policy, and drafting k every step")
    args = parser.parse_args()
    torch.manual_seed(0)
    cache = Path(os.environ.get("BATCHGEN_DATA_CACHE", Path.home() / ".cache" / "batchgen-data"))
    folder = cache / BENCH_MODELS[args.arch][0]
    build_bench_model(folder, arch=args.arch)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    workload = make_workload(args.requests, args.p95_output, args.median_prompt, vocab)
    engine = Engine(folder, EngineConfig(max_num_seqs=args.max_num_seqs, collect_timeline=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k}))
    warm = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 4
    engine.generate(workload.prompts[:4], warm)
    first = run(engine, workload, "off (warm-up)")  # allocator, kernels, the policy's step costs
    table = {tuple(p): out for p, out in zip(workload.prompts, first["outputs"])}
    results = [run(engine, workload, "off")]
    oracle = TableProposer(table, vocab)
    results.append(run(engine, workload, f"oracle-k{args.k}", oracle, fixed=args.k))
    results.append(run(engine, workload, "oracle-adaptive", oracle))
    results.append(run(engine, workload, "never-right", TableProposer(table, vocab, wrong=True)))
    results.append(run(engine, workload, "ngram"))
    results.append(run(engine, workload, "suffix", SuffixProposer()))
    if args.mtp:
        results += _mtp_runs(args, cache, workload)
    results.append(run(engine, workload, "off (again)"))
    engine.close()
    base = results[0]
    for r in results[1:]:
        r["identical_to_off"] = r["outputs"] == base["outputs"]
    off_wall = (results[0]["wall_s"] + results[-1]["wall_s"]) / 2
    off_tail = (results[0]["tail_s"] + results[-1]["tail_s"]) / 2
    print(f"{cpu_model()}; {args.arch}, {args.requests} requests, {base['tokens']} output tokens, k = {args.k}")
    print(f"{'run':16s} {'wall s':>7s} {'tok/s':>7s} {'vs off':>7s} {'tail s':>7s} {'tail vs off':>11s} "
          f"{'tail steps':>10s} {'tok/step':>8s} {'drafted':>8s} {'accepted':>8s} same")
    for r in results:
        r["wall_vs_off"] = off_wall / r["wall_s"]
        r["tail_vs_off"] = off_tail / r["tail_s"] if r["tail_s"] else 0.0
        print(f"{r['name']:16s} {r['wall_s']:7.2f} {r['tokens_per_s']:7.1f} {r['wall_vs_off']:6.2f}x "
              f"{r['tail_s']:7.2f} {r['tail_vs_off']:10.2f}x {r['tail_steps']:10d} {r['tail_tokens_per_step']:8.2f} "
              f"{r['drafted']:8d} {r['accepted']:8d} {r.get('identical_to_off', True)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for r in results:
        del r["outputs"]
    stem = f"speculative-{args.arch}-cpu"
    head = json.dumps({"cpu": cpu_model(), "arch": args.arch, "k": args.k, "requests": args.requests}, indent=1)
    runs = ",\n".join("  " + json.dumps(r) for r in results)  # a run (with its step timeline) per line
    (args.out / f"{stem}.json").write_text(f'{head[:-2]},\n "runs": [\n{runs}\n ]\n}}\n')
    _plot(results, args.out / f"{stem}.png")


def _mtp_runs(args, cache: Path, workload) -> list[dict]:
    """The same model with a random MTP layer (``build_bench_mtp_model``; its own engine, warmed
    up first): the layer's catch-up alone (drafting off), under the policy, and k every step."""
    folder = build_bench_mtp_model(cache / f"{BENCH_MODELS[args.arch][0]}-mtp", args.arch)
    engine = Engine(folder, EngineConfig(max_num_seqs=args.max_num_seqs, collect_timeline=True, speculative_config={
        "method": "mtp", "num_speculative_tokens": args.k}))
    run(engine, workload, "mtp (warm-up)", enabled=False)
    results = [run(engine, workload, "mtp catch-up only", enabled=False), run(engine, workload, "mtp"),
               run(engine, workload, f"mtp-k{args.k}", fixed=args.k)]
    engine.close()
    return results


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r in results:
        if r["name"] in ("off", "oracle-adaptive", "ngram", "suffix") or r["name"].startswith("oracle-k"):
            ax.step([t for t, _, _ in r["timeline"]], [n for _, n, _ in r["timeline"]], where="post",
                    label=f"{r['name']} (tail {r['tail_s']:.1f} s)")
    ax.set_ylim(0, 16)
    ax.set_xlabel("seconds")
    ax.set_ylabel("running sequences (<= 16 shown)")
    ax.legend()
    ax.set_title("The tail of a skewed batch job, with and without speculative decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
