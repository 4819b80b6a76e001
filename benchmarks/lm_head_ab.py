"""The chunked LM head (``model/lm_head_topk.py``) against whole logits, in one process.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/lm_head_ab.py   # ~3 min

On the demo model (152k vocabulary), ``--rows`` greedy rows x ``--max-tokens`` tokens, with no
logprobs and with ``logprobs=5``, ``--reps`` alternating repetitions of the same engine with its
``HeadChoice`` (the chunked head where the first steps timed it faster) and with the whole
logits always (``HeadChoice(enabled=False)``). Reports the median and min / max of the
per-repetition ratio chunked-allowed / whole, which chunked sizes were chosen, and whether the
tokens are identical. Writes ``lm-head-ab-cpu.json`` under ``--out`` (default ``docs/results``).

``--constraint counted_regex`` / ``maxlength``: every row under ``[a-z]{400}`` or a JSON string
of ``minLength 300, maxLength 400`` (lazy rows nearly every step), no logprobs, the chunked head
forced for every step (not timed) against the whole logits; writes
``lm-head-ab-<constraint>-cpu.json``.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/lm_head_ab.py --rows 48,64 --constraint counted_regex
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from batchgen_data.model.lm_head_topk import GRAMMAR, LOGPROBS, PLAIN, HeadChoice  # noqa: E402

CONSTRAINTS = {
    "counted_regex": {"regex": "[a-z]{400}"},
    "maxlength": {"json": {"type": "object", "properties": {"name": {"type": "string", "minLength": 300,
                                                                      "maxLength": 400}},
                           "required": ["name"], "additionalProperties": False}, "disable_any_whitespace": True},
}
ALWAYS_CHUNKED = {(bucket, kind): True for bucket in range(64) for kind in (PLAIN, LOGPROBS, GRAMMAR)}
KIND_NAMES = {PLAIN: "plain", LOGPROBS: "+logprobs", GRAMMAR: "grammar"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="40,48,56,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--constraint", choices=("none", *CONSTRAINTS), default="none")
    args = parser.parse_args()
    constraint = CONSTRAINTS.get(args.constraint)
    sizes = [int(r) for r in args.rows.split(",")]
    engine = Engine("demo", EngineConfig(max_num_seqs=max(sizes)))
    runner = engine.executor.runner
    result = {"cpu": cpu_model(), "max_tokens": args.max_tokens, "reps": args.reps, "constraint": args.constraint,
              "runs": []}
    print(f"{cpu_model()}: chunked-allowed / whole logits, wall per run, {args.reps} alternating reps")
    for rows in sizes:
        prompts = [f"Row {i}: label this review, number {i * 7919 % 1000}" for i in range(rows)]
        for logprobs in (None, 5) if constraint is None else (None,):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs,
                                    structured_outputs=constraint)
            chunked = HeadChoice() if constraint is None else HeadChoice(enabled=True, chosen=ALWAYS_CHUNKED)
            choices = {"chunked": chunked, "whole": HeadChoice(enabled=False)}
            times: dict[str, list[float]] = {name: [] for name in choices}
            tokens: dict[str, list] = {}
            for rep in range(args.reps + 1):  # the first round warms up (and lets the choice time both ways)
                for name in (list(choices) if rep % 2 == 0 else list(reversed(choices))):
                    runner.head_choice = choices[name]
                    start = time.perf_counter()
                    outs = engine.generate(prompts, params)
                    if rep:
                        times[name].append(time.perf_counter() - start)
                    tokens[name] = [o.token_ids for o in outs]
            ratios = [a / b for a, b in zip(times["chunked"], times["whole"])]
            chosen = sorted(f"{8 * bucket}-{8 * bucket + 7} rows {KIND_NAMES[kind]}"
                            for (bucket, kind), on in choices["chunked"].chosen.items() if on and constraint is None)
            run = {"rows": rows, "logprobs": logprobs, "whole_s": statistics.median(times["whole"]),
                   "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
                   "chunked_chosen_for": chosen, "tokens_identical": tokens["chunked"] == tokens["whole"]}
            result["runs"].append(run)
            r = run["ratio"]
            print(f"  {rows:3d} rows, logprobs={logprobs}: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}), "
                  f"whole {run['whole_s']:.2f} s, chunked chosen for {chosen or 'none'}, "
                  f"tokens identical: {run['tokens_identical']}")
    engine.close()
    args.out.mkdir(parents=True, exist_ok=True)
    name = "lm-head-ab-cpu.json" if constraint is None else f"lm-head-ab-{args.constraint}-cpu.json"
    (args.out / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
