"""Ray Data pipeline: triage the bundled support tickets with ``BatchGenOperator``, write Parquet.

    python examples/ray_pipeline.py                        # output under a new temp folder
    python examples/ray_pipeline.py /tmp/triage --max-tokens 32
    python examples/ray_pipeline.py /tmp/triage --model /path/to/qwen3-moe-checkpoint

Reads ``examples/data/support_tickets.jsonl``, adds a ``prompt`` column, generates on one actor
and writes one Parquet folder with the ticket columns plus the generated ones. With the demo
model (random weights) the replies are gibberish; the pipeline is what this shows.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import prompts
import pyarrow.parquet as pq
import ray

from batchgen_data import BatchGenOperator

# 24 tickets fit in one running set; a small set keeps the KV pool small on a laptop.
ENGINE_CONFIG = {"max_num_seqs": 32}
BATCH_SIZE = 8


def add_prompt(row: dict) -> dict:
    return {**row, "prompt": prompts.build_prompt(row)}


def main(output_dir: str, max_tokens: int = 16, model: str = "demo") -> str:
    """Run the pipeline into ``output_dir`` (a Parquet folder) and return its path.

    Starts (and stops) a local Ray cluster only when Ray is not initialized yet.
    """
    # examples/ is not installed, so Ray workers cannot import these modules: ship them by value.
    for module in (prompts, sys.modules[__name__]):
        ray.cloudpickle.register_pickle_by_value(module)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster needs no tokens
        temp_dir = tempfile.mkdtemp(prefix="batchgen-ray-")
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        ds = ray.data.read_json(str(prompts.TICKETS_PATH)).map(add_prompt)
        ds = ds.map_batches(
            BatchGenOperator,
            fn_constructor_kwargs={
                "model": model,
                "max_tokens": max_tokens,
                "engine_config": ENGINE_CONFIG,
            },
            batch_size=BATCH_SIZE,
            compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=2),
            num_cpus=0.5,  # whole CPUs would starve the read and map tasks on a 2-core machine
        )
        ds.write_parquet(output_dir)
    finally:
        if owns_ray:
            ray.shutdown()
    table = pq.read_table(output_dir).sort_by("ticket_id")
    for row in table.slice(0, 3).to_pylist():
        print(
            f"#{row['ticket_id']} [{row['product']}] -> {row['generated_text']!r} "
            f"({row['num_generated_tokens']} tokens, {row['finish_reason']})"
        )
    print(f"wrote {table.num_rows} rows to {output_dir}")
    return output_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", help="Parquet folder (default: a new temp folder)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="batchgen-tickets-")
    main(output_dir, args.max_tokens, args.model)
