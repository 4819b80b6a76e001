"""What vLLM's logits processors cost: the same decode with and without them on 1/4 of the rows.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/sampling_cost.py   # ~2 min

On the demo model (152k vocabulary), ``--rows`` rows x ``--max-tokens`` sampled tokens
(temperature 0.8, seeded), ``--reps`` alternating repetitions of: every row plain, and every
fourth row with ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias`` and ``min_p``; the median ratio of time per output token (target: at most 1.03).
Then the sampler alone on one [rows, V] logits matrix, plain and mixed, with the per-row data
built each step as the model runner does. Both in wall time and in this process's CPU time: on a
machine other jobs share, wall time swings with them; ``--threads 1`` makes the CPU time of the
run its own work (no threads waiting for each other). Writes ``sampling-cost-cpu.json`` under
``--out`` (default ``docs/results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.engine.sample.processors import ProcessorRows  # noqa: E402
from batchgen_data.engine.sample.sampler import Sampler, SamplingBatch  # noqa: E402

TEMPERATURE = 0.8
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
PROCESSED = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3, "min_p": 0.05,
             "logit_bias": {11: 2.0, 220: -1.5, 1000: 0.5}}


def _params(rows: int, max_tokens: int, mixed: bool) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, seed=i, ignore_eos=True,
                           **(PROCESSED if mixed and i % 4 == 0 else {})) for i in range(rows)]


def engine_runs(rows: int, max_tokens: int, reps: int) -> dict:
    engine = Engine("demo", EngineConfig(max_num_seqs=rows))
    prompts = [f"Row {i}: label this review, number {i * 7919 % 1000}" for i in range(rows)]
    runs = {"plain": _params(rows, max_tokens, False), "mixed": _params(rows, max_tokens, True)}
    for params in runs.values():
        engine.generate(prompts[:8], params[:8])  # warm-up
    per_token = {clock: {name: [] for name in runs} for clock in CLOCKS}
    for rep in range(reps):
        for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
            start = {clock: read() for clock, read in CLOCKS.items()}
            outs = engine.generate(prompts, runs[name])
            num_tokens = sum(o.num_generated_tokens for o in outs)
            for clock, read in CLOCKS.items():
                per_token[clock][name].append(1e3 * (read() - start[clock]) / num_tokens)
    vocab = engine.executor.model.config.vocab_size
    engine.close()
    return {"vocab": vocab, "ms_per_token": per_token, **_ratios(per_token)}


def sampler_runs(rows: int, vocab: int, max_tokens: int, reps: int) -> dict:
    """One decode step's sampling (per-row data built from the rows' params and histories, then
    the sampler), plain vs mixed, on the same logits."""
    generator = torch.Generator().manual_seed(0)
    source = 4 * torch.randn(rows, vocab, generator=generator)
    prompts = [torch.randint(0, vocab, (48,), generator=generator).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (max_tokens,), generator=generator).tolist() for _ in range(rows)]
    sampler = Sampler()
    times = {clock: {"plain": [], "mixed": []} for clock in CLOCKS}
    for rep in range(reps):
        for name in (("plain", "mixed") if rep % 2 == 0 else ("mixed", "plain")):
            params = _params(rows, max_tokens, name == "mixed")
            logits = source.clone()
            start = {clock: read() for clock, read in CLOCKS.items()}
            batch = SamplingBatch.build([p.temperature for p in params], [p.top_p for p in params],
                                        [p.top_k for p in params], [p.seed for p in params], [max_tokens] * rows,
                                        processors=ProcessorRows.build(params, prompts, outputs))
            sampler(logits, batch)
            for clock, read in CLOCKS.items():
                times[clock][name].append(1e3 * (read() - start[clock]))
    return {"ms_per_step": times, **_ratios(times)}


def _ratios(times: dict) -> dict:
    """Per clock: the median of the paired (same repetition) mixed / plain ratios, and their range."""
    out = {}
    for clock, runs in times.items():
        ratios = [m / p for m, p in zip(runs["mixed"], runs["plain"])]
        out[f"{clock}_ratio"] = statistics.median(ratios)
        out[f"{clock}_ratio_range"] = (min(ratios), max(ratios))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sampler-reps", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = engine_runs(args.rows, args.max_tokens, args.reps)
    sampler = sampler_runs(args.rows, engine["vocab"], args.max_tokens, args.sampler_reps)
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "rows": args.rows,
              "max_tokens": args.max_tokens, "processed_rows": (args.rows + 3) // 4, "processed": {
                  k: v if not isinstance(v, dict) else {str(t): b for t, b in v.items()} for k, v in PROCESSED.items()},
              "engine": engine, "sampler": sampler}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampling-cost-cpu.json").write_text(json.dumps(result, indent=2))
    print(f"{result['cpu']}, {result['threads']} threads; {args.rows} rows x {args.max_tokens} tokens, "
          f"1 row in 4 with penalties + logit_bias + min_p; medians of paired repetitions")
    for what, unit, runs in (("engine", "ms/token", engine["ms_per_token"]), ("sampler", "ms/step", sampler["ms_per_step"])):
        for clock in CLOCKS:
            low, high = result[what][f"{clock}_ratio_range"]
            print(f"  {what:7s} {clock:4s} plain {statistics.median(runs[clock]['plain']):8.3f} {unit}, "
                  f"mixed {statistics.median(runs[clock]['mixed']):8.3f}: {result[what][f'{clock}_ratio']:.3f}x "
                  f"(range {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
