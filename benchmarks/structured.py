"""Structured outputs benchmark: constrained vs unconstrained decoding at the same shapes.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/structured.py   # ~4 min

On the demo model (152k vocabulary), ``--rows`` rows x ``--max-tokens`` greedy tokens each:
  * time per output token, unconstrained vs a JSON schema (a bounded string then an array of
    enums: dense and sparse masks) vs a regex (sparse masks) vs a counted regex (``[a-z]{400}``)
    vs a JSON string with ``minLength: 300, maxLength: 400``, the last two warm, cold (a grammar the engine has
    not seen, every repetition) and, for the schema, one distinct schema per row; each constraint
    long enough that every row generates all its tokens, so the batch shapes are the same;
    ``--reps`` alternating repetitions, the median ratio reported with min and max (target:
    within 10%);
  * the engine's first constrained request, which builds the tokenizer view;
  * the per-step cost split: mask filling (llguidance, with the lazy picks' checks) and the share of
    greedy tokens picked without a mask (``structured/lazy.py``), mask applying (our kernel, and the
    libraries' own CPU kernels for comparison);
  * compile time per schema (after the one-off tokenizer view, also reported);
  * well-formedness: choice, regex and schema rows that finish with "stop" match / validate.
Writes ``structured-cpu.json`` under ``--out`` (default ``docs/results``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.engine.sample.bitmask import apply_token_bitmask  # noqa: E402
from batchgen_data.engine.structured.compiler import GrammarCompiler  # noqa: E402
from batchgen_data.engine.structured.params import StructuredOutputsParams  # noqa: E402

# Long enough that no row finishes before --max-tokens: the same shapes as the unconstrained run.
# An extraction schema: an array of enums (sparse masks), a bounded integer, then free text (a
# random model never closes the string: dense masks, nearly every token allowed).
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                 "minItems": 6},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string"},
    },
    "required": ["tags", "rating", "summary"],
    "additionalProperties": False,
}
# The same with a length-bounded string: llguidance's slowest masks (a counting lexer state).
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 8, "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                 "minItems": 40},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
LONG_REGEX = r"(yes|no|maybe)( (yes|no|maybe)){60}"
# Counted repetition and a long bounded string, as a new user writes them (issue #36): every
# row stays inside the repetition for all its tokens. "_cold" runs use a grammar the engine has
# not seen (a new count each repetition: compile and the lexer's lazily built states included);
# "per_row" gives every row its own schema (48 compiles a run).
COUNTED_REGEX = "[a-z]{%d}"
MAXLEN_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 300, "maxLength": 400}},
                 "required": ["name"], "additionalProperties": False}  # minLength: no row closes it early
CONSTRAINED_RUNS = ("json", "regex", "json_bounded", "counted_regex", "counted_regex_cold", "json_maxlength",
                    "json_maxlength_cold", "json_maxlength_per_row")
# For well-formedness: small constraints a random model completes within max_tokens.
CHECK_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "flagged": {"type": "boolean"},
        "topics": {"type": "array", "items": {"type": "string", "enum": ["price", "service", "food"]},
                   "maxItems": 3},
    },
    "required": ["label", "score", "flagged", "topics"],
    "additionalProperties": False,
}
CHECK_REGEX = r"[A-Z]{2}-[0-9]{3}"
CHECK_CHOICE = ["positive", "negative", "neutral"]
SCHEMAS_TO_COMPILE = {"long": LONG_SCHEMA, "bounded": BOUNDED_SCHEMA, "check": CHECK_SCHEMA,
                      "nested": {"type": "object", "properties": {
                          "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                    "email": {"type": "string"}},
                                   "required": ["id"]},
                          "items": {"type": "array", "items": {"type": "object", "properties": {
                              "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}}},
                          "required": ["user", "items"]}}


def timed_run(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, int, float, int]:
    """(wall seconds, generated tokens, mask-fill seconds, greedy rows picked without their
    mask) of one generate call."""
    structured = engine.executor.structured
    fill_before, lazy_before = structured.mask_s, structured.lazy_picks
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    bad = [o for o in outputs if o.error]
    if bad:
        raise RuntimeError(f"benchmark row failed: {bad[0].error}")
    return (wall, sum(o.num_generated_tokens for o in outputs), structured.mask_s - fill_before,
            structured.lazy_picks - lazy_before)


def _maxlength(length: int) -> dict:
    return {"json": {**MAXLEN_SCHEMA, "properties": {"name": {"type": "string", "minLength": 300,
                                                               "maxLength": length}}},
            "disable_any_whitespace": True}


def per_token(args, engine: Engine, prompts: list[str]) -> dict:
    """Each run's params for repetition ``rep``: one ``SamplingParams`` for all rows, or a list."""
    base = dict(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def same(constraint):
        params = SamplingParams(**base, structured_outputs=constraint) if constraint else SamplingParams(**base)
        return lambda rep: params

    fresh = itertools.count(1000)  # counts no other run uses: a grammar never seen
    runs = {
        "unconstrained": same(None),
        "json": same({"json": LONG_SCHEMA, "disable_any_whitespace": True}),
        "regex": same({"regex": LONG_REGEX}),
        "json_bounded": same({"json": BOUNDED_SCHEMA, "disable_any_whitespace": True}),
        "counted_regex": same({"regex": COUNTED_REGEX % 400}),
        "counted_regex_cold": lambda rep: SamplingParams(**base, structured_outputs={
            "regex": COUNTED_REGEX % (400 + next(fresh))}),
        "json_maxlength": same(_maxlength(400)),
        "json_maxlength_cold": lambda rep: SamplingParams(**base, structured_outputs=_maxlength(400 + next(fresh))),
        "json_maxlength_per_row": lambda rep: [SamplingParams(**base, structured_outputs=_maxlength(
            400 + next(fresh))) for _ in prompts],
    }
    for name, params_of in runs.items():  # warm-up: kernels, the tokenizer view, the warm grammars
        params = params_of(-1)
        engine.generate(prompts[:4], params[:4] if isinstance(params, list) else params)
    samples: dict[str, list[tuple[float, int, float, int]]] = {name: [] for name in runs}
    for rep in range(args.reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            samples[name].append(timed_run(engine, prompts, runs[name](rep)))
    result = {}
    steps = args.max_tokens  # one sampled token per row per step (prefill samples the first)
    for name, reps in samples.items():
        ms_per_token = [1e3 * wall / tokens for wall, tokens, _, _ in reps]
        result[name] = {
            "ms_per_token": ms_per_token,
            "median_ms_per_token": statistics.median(ms_per_token),
            "tokens": reps[0][1],
            "fill_ms_per_step": statistics.median(1e3 * fill / steps for _, _, fill, _ in reps),
            # the share of tokens picked from the argmax without filling a mask (greedy rows)
            "lazy_pick_share": statistics.median(lazy / tokens for _, tokens, _, lazy in reps),
        }
    for name in CONSTRAINED_RUNS:
        ratios = [c / u for c, u in zip(result[name]["ms_per_token"], result["unconstrained"]["ms_per_token"])]
        result[name]["ratio_vs_unconstrained"] = statistics.median(ratios)
        result[name]["ratios"] = ratios
    return result


def apply_costs(engine: Engine, rows: int) -> dict:
    """Mask-apply time per step for ``rows`` greedy rows in four states of ``LONG_SCHEMA`` (start,
    in the enum array, in the integer, in the free string: sparse and dense masks): our kernel
    vs the libraries' own CPU kernels."""
    import llguidance.numpy as llg_numpy

    tokenizer = engine.tokenizer.hf
    vocab = engine.executor.model.config.vocab_size
    grammar = engine.executor.structured.compiler.submit(
        StructuredOutputsParams(json=LONG_SCHEMA, disable_any_whitespace=True)).result()
    states = ['', '{"tags":["al', '{"tags":["alpha","beta","gamma","beta","beta","alpha"],"rating":',
              '{"tags":["alpha","beta","gamma","beta","beta","alpha"],"rating":3,"summary":"It was']
    masks = []
    for prefix in states:
        matcher = grammar.new_matcher()
        for token in tokenizer.encode(prefix):
            assert matcher.consume_token(token), (prefix, matcher.get_error())
        mask = llg_numpy.allocate_token_bitmask(1, vocab)
        llg_numpy.fill_next_token_bitmask(matcher, mask)
        masks.append(mask[0])
    mask = np.stack([masks[i % len(masks)] for i in range(rows)])
    logits = torch.randn(rows, vocab)
    row_ids, greedy = list(range(rows)), [True] * rows

    def best_of(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    out = {"ours_greedy_ms": best_of(lambda: apply_token_bitmask(logits, mask, row_ids, greedy), 20),
           "ours_sampling_ms": best_of(lambda: apply_token_bitmask(logits, mask, row_ids, [False] * rows), 20),
           "allowed_per_state": [int(np.bitwise_count(m.view(np.uint32)).sum()) for m in masks]}
    out["llguidance_numpy_ms"] = best_of(lambda: llg_numpy.apply_token_bitmask_inplace(logits.numpy(), mask), 3)
    try:  # xgrammar is not a dependency; measured when installed
        import xgrammar

        out["xgrammar_cpu_ms"] = best_of(lambda: xgrammar.apply_token_bitmask_inplace(logits, torch.from_numpy(mask)), 3)
    except ImportError:
        out["xgrammar_cpu_ms"] = None
    return out


def compile_costs(engine: Engine) -> dict:
    model = engine.executor.model
    compiler = GrammarCompiler(engine.model_path, model.config.vocab_size, engine.tokenizer.eos_token_ids,
                               engine.tokenizer.hf)
    start = time.perf_counter()  # the first view, from the tokenizer (regex and grammar constraints)
    compiler.submit(StructuredOutputsParams(regex="x")).result()
    out = {"tokenizer_view_s": time.perf_counter() - start}
    start = time.perf_counter()  # the JSON view, from the first
    compiler.submit(StructuredOutputsParams(json={"type": "boolean"})).result()
    out["json_view_s"] = time.perf_counter() - start
    for name, regex in (("counted_regex", COUNTED_REGEX % 400), ("code_regex", r"[A-Z]{3}-[0-9]{300}")):
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(regex=regex)).result()
        out[f"compile_{name}_ms"] = 1e3 * (time.perf_counter() - start)
    for name, schema in SCHEMAS_TO_COMPILE.items():
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=schema)).result()
        out[f"compile_{name}_ms"] = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=schema)).result()
        out[f"cached_{name}_ms"] = 1e3 * (time.perf_counter() - start)
    compiler.close()
    return out


def well_formed(engine: Engine, prompts: list[str]) -> dict:
    import jsonschema

    kinds = {
        "choice": ({"choice": CHECK_CHOICE}, lambda t: t in CHECK_CHOICE),
        "regex": ({"regex": CHECK_REGEX}, lambda t: re.fullmatch(CHECK_REGEX, t) is not None),
        "json": ({"json": CHECK_SCHEMA, "disable_any_whitespace": True},
                 lambda t: jsonschema.Draft202012Validator(CHECK_SCHEMA).is_valid(json.loads(t))),
    }
    result = {}
    for name, (constraint, check) in kinds.items():
        outputs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.7, seed=1,
                                                          structured_outputs=constraint))
        stopped = [o for o in outputs if o.finish_reason == "stop"]
        result[name] = {"rows": len(outputs), "stopped": len(stopped),
                        "well_formed": sum(1 for o in stopped if check(o.text))}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    engine = Engine("demo", EngineConfig(max_num_seqs=64))
    prompts = [f"Row {i}: extract the fields of this customer review, number {i * 7919 % 1000}" for i in range(args.rows)]
    engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0))  # kernels, buffers
    start = time.perf_counter()  # an engine's first constrained request builds the tokenizer view
    engine.generate(prompts[:1], SamplingParams(max_tokens=1, structured_outputs={"regex": COUNTED_REGEX % 400}))
    first_request_s = time.perf_counter() - start
    result = {
        "cpu": cpu_model(),
        "first_constrained_request_s": first_request_s,
        "torch_threads": torch.get_num_threads(),
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "per_token": per_token(args, engine, prompts),
        "apply": apply_costs(engine, args.rows),
        "compile": compile_costs(engine),
        "well_formed": well_formed(engine, prompts),
    }
    engine.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured-cpu.json").write_text(json.dumps(result, indent=2))
    pt = result["per_token"]
    print(f"{result['cpu']}; the engine's first constrained request (tokenizer view): {first_request_s:.2f} s")
    print(f"{args.rows} rows x {args.max_tokens} tokens, median of {args.reps}:")
    for name in ("unconstrained", *CONSTRAINED_RUNS):
        ratio = pt[name].get("ratio_vs_unconstrained")
        print(f"  {name:22s} {pt[name]['median_ms_per_token']:.3f} ms/token"
              + (f"  {ratio:.3f}x unconstrained (min {min(pt[name]['ratios']):.3f}, max {max(pt[name]['ratios']):.3f});"
                 f" mask fill {pt[name]['fill_ms_per_step']:.2f} ms/step;"
                 f" picked without a mask {100 * pt[name]['lazy_pick_share']:.0f}%" if ratio else ""))
    print("  apply (ms per step):", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in result["apply"].items()})
    print("  compile:", {k: round(v, 3) for k, v in result["compile"].items()})
    print("  well formed:", result["well_formed"])


if __name__ == "__main__":
    main()
