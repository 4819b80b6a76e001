"""``run-batch`` against ``run`` on the same rows: what reading and writing OpenAI Batch files costs.

The README's sample tickets (``examples/data/support_tickets.jsonl``), each rendered with the
triage prompt (``examples/data/triage_prompt.txt``) and repeated ``--copies`` times, run as a
``run`` job (a ``prompt`` column) and as a ``run-batch`` job (``/v1/completions`` lines with the
same prompt, ``max_tokens`` and greedy sampling), alternating, each command in a fresh process,
timed from start to exit (model load, reading, generation and writing included). Reports each
repetition's wall seconds and the ratio ``run_batch_s / run_s``, and checks that both
generated the same texts.

    python benchmarks/run_batch.py --copies 8 --reps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from batchgen_data.hardware import cpu_model

REPO = Path(__file__).resolve().parent.parent
ENGINE_ARGS = ["--max-num-seqs", "64", "--no-progress"]


def write_inputs(folder: Path, copies: int, max_tokens: int) -> tuple[Path, Path]:
    template = (REPO / "examples/data/triage_prompt.txt").read_text()
    tickets = [json.loads(line) for line in (REPO / "examples/data/support_tickets.jsonl").read_text().splitlines()]
    prompts = [template.format(**ticket) + f" (copy {copy})" for copy in range(copies) for ticket in tickets]
    rows, batch = folder / "rows.jsonl", folder / "batch.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    batch.write_text("".join(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": "demo", "prompt": p, "max_tokens": max_tokens,
                                                  "temperature": 0}}) + "\n" for i, p in enumerate(prompts)))
    return rows, batch


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "batchgen_data.jobs.cli"]
    folder = Path(tempfile.mkdtemp(prefix="bench-run-batch-"))
    try:
        rows, batch = write_inputs(folder, args.copies, args.max_tokens)
        reps = []
        for rep in range(args.reps):
            run_out, batch_out = folder / f"run-{rep}", folder / f"batch-{rep}.jsonl"
            run_s = timed([*cli, "run", str(rows), str(run_out), "--output-format", "jsonl",
                           "--max-tokens", str(args.max_tokens), *ENGINE_ARGS])
            batch_s = timed([*cli, "run-batch", "-i", str(batch), "-o", str(batch_out), *ENGINE_ARGS])
            texts = [json.loads(line)["generated_text"] for part in sorted(run_out.glob("part-*"))
                     for line in part.read_text().splitlines()]
            answers = [json.loads(line)["response"]["body"]["choices"][0]["text"]
                       for line in batch_out.read_text().splitlines()]
            reps.append({"run_s": round(run_s, 3), "run_batch_s": round(batch_s, 3),
                         "ratio": round(batch_s / run_s, 4), "same_texts": texts == answers})
            print(json.dumps(reps[-1]), flush=True)
        result = {"cpu": cpu_model(), "rows": len(texts), "max_tokens": args.max_tokens, "reps": reps,
                  "median_ratio": median(r["ratio"] for r in reps)}
        print(json.dumps(result))
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
