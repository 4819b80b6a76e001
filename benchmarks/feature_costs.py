"""What each feature costs per output token, swept over running-set sizes and job lengths, judged
at its worst point (issue #54: a cost that holds at one benchmark point can miss at others).

For every job length L (``--lengths``, default a short 16-token and a long 256-token job) and
running-set size N (``--sizes``: N rows submitted together, all running at once), the same N
prompts run greedy for L tokens each (``ignore_eos``, so every row generates all L) without the
feature and with it, alternating which goes first, ``--reps`` times; the point's figure is the
median of the per-repetition ratios of milliseconds per output token, feature / plain. A grammar
that completes ends its rows before L, each at its own length: the plain rows then run to those
same lengths (``plain_like``, learned from one run of the feature first), so both jobs have the
same shape. The report gives each feature's worst point, the figure a target is judged on.

Features (``--features``, default all): ``logprobs1`` / ``logprobs5`` / ``logprobs20``
(``logprobs=k``), ``prompt_logprobs`` (5), ``regex`` (an alternation repeated 60 times),
``counted_regex`` (``[a-z]{400}``, warm), ``counted_regex_cold`` (a count the engine has not
seen, every repetition: its compile in the job's time), ``json_maxlength`` (a string of 300-400
characters, compact), ``per_row_schemas`` (each row its own such schema, new every
repetition), ``penalties`` (presence, frequency and repetition penalties).

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/feature_costs.py \\
        --sizes 1,8,16,32,48,64,128,256 --lengths 16,256 --reps 3      # the whole sweep: hours here
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.hardware import cpu_model

MAXLEN_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 300, "maxLength": 400}},
                 "required": ["name"], "additionalProperties": False}


def _maxlength(length: int) -> dict:
    schema = {**MAXLEN_SCHEMA, "properties": {"name": {"type": "string", "minLength": 300, "maxLength": length}}}
    return {"json": schema, "disable_any_whitespace": True}


def feature_params(length: int) -> dict[str, Callable[[int], SamplingParams | list[SamplingParams]]]:
    """Each feature's params for ``n`` rows of a job of ``length`` tokens (a new call: a new
    grammar for the cold ones)."""
    base = {"max_tokens": length, "temperature": 0, "ignore_eos": True}
    fresh = itertools.count(1000)

    def same(**extra):
        return lambda n: SamplingParams(**base, **extra)

    return {
        "plain": same(),  # A/A: the same rows twice, the run-to-run spread the other ratios sit in
        "logprobs1": same(logprobs=1),
        "logprobs5": same(logprobs=5),
        "logprobs20": same(logprobs=20),
        "prompt_logprobs": same(prompt_logprobs=5),
        "regex": same(structured_outputs={"regex": r"(yes|no|maybe)( (yes|no|maybe)){60}"}),
        "counted_regex": same(structured_outputs={"regex": "[a-z]{400}"}),
        "counted_regex_cold": lambda n: SamplingParams(**base, structured_outputs={"regex": f"[a-z]{{{400 + next(fresh)}}}"}),
        "json_maxlength": same(structured_outputs=_maxlength(400)),
        "per_row_schemas": lambda n: [SamplingParams(**base, structured_outputs=_maxlength(400 + next(fresh)))
                                      for _ in range(n)],
        "penalties": same(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    }


def timed_generate(engine: Engine, prompts: list[str], params) -> tuple[float, list[int]]:
    """One job: its wall seconds and each row's output length (a failed row is an error)."""
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    bad = [o.error for o in outputs if o.error]
    if bad:
        raise RuntimeError(f"benchmark row failed: {bad[0]}")
    return wall, [o.num_generated_tokens for o in outputs]


def _run(engine: Engine, prompts: list[str], params) -> tuple[float, list[int]]:
    """Milliseconds per output token, and each row's output length."""
    wall, lengths = timed_generate(engine, prompts, params)
    return 1e3 * wall / sum(lengths), lengths


def plain_like(lengths: list[int]) -> list[SamplingParams]:
    """The plain rows of the same shape as a feature's: each row as long as the feature's row
    was. A grammar that completes ends its row early, each at its own length; plain rows all
    running to the job's length would compare a job of another shape (fewer tokens to spread
    the prefill over, a running set that thins out as rows end)."""
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]


def sweep(engine: Engine, features: list[str], sizes: list[int], lengths: list[int], reps: int) -> list[dict]:
    points = []
    for length in lengths:
        params_of = feature_params(length)
        plain = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
        for name in features:  # warm-up: kernels, the tokenizer view, the warm grammars
            engine.generate(["warm up"] * 4, params_of[name](4))
        for size in sizes:
            prompts = [f"Ticket {i}: the parcel arrived late and the box was {'wet' if i % 3 else 'torn'}."
                       for i in range(size)]
            for name in features:
                ratios = []
                _, lengths = _run(engine, prompts, params_of[name](size))  # the rows' lengths (greedy: every run's)
                base = plain_like(lengths) if min(lengths) < length else plain
                for rep in range(reps):
                    params = params_of[name](size)
                    if rep % 2 == 0:
                        base_ms, _ = _run(engine, prompts, base)
                        feature_ms, _ = _run(engine, prompts, params)
                    else:
                        feature_ms, _ = _run(engine, prompts, params)
                        base_ms, _ = _run(engine, prompts, base)
                    ratios.append(feature_ms / base_ms)
                point = {"feature": name, "rows": size, "tokens": length, "ratios": [round(r, 4) for r in ratios],
                         "median_ratio": round(statistics.median(ratios), 4),
                         "mean_tokens": round(statistics.fmean(lengths), 1)}
                points.append(point)
                print(json.dumps(point), flush=True)
    return points


def worst(points: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for point in points:
        if point["feature"] not in out or point["median_ratio"] > out[point["feature"]]["median_ratio"]:
            out[point["feature"]] = point
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,16,32,48,64,128,256")
    parser.add_argument("--lengths", default="16,256")
    parser.add_argument("--features", default=",".join(feature_params(16)))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    features = args.features.split(",")
    unknown = sorted(set(features) - set(feature_params(16)))
    if unknown:
        parser.error(f"unknown features {unknown}")
    engine = Engine("demo", EngineConfig(max_num_seqs=max(sizes), max_num_batched_tokens=max(2048, max(sizes))))
    points = sweep(engine, features, sizes, lengths, args.reps)
    result = {"cpu": cpu_model(), "sizes": sizes, "lengths": lengths, "reps": args.reps, "points": points,
              "worst": worst(points)}
    print("worst point per feature (median ratio of ms per output token, feature / plain):")
    for name, point in result["worst"].items():
        print(f"  {name:20s} {point['median_ratio']:.3f}x at {point['rows']} rows x {point['tokens']} tokens")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
