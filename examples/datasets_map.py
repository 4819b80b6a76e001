"""Hugging Face ``datasets``: triage the bundled support tickets with ``BatchGenMap``.

    python examples/datasets_map.py                     # the demo model, 16 new tokens per ticket
    python examples/datasets_map.py --max-tokens 32 --model /path/to/qwen3-moe-checkpoint

Builds a ``datasets.Dataset`` from ``examples/data/support_tickets.jsonl``, adds a ``prompt``
column, then ``.map(BatchGenMap(...), batched=True)`` adds the generated columns. With the demo
model (random weights) the replies are gibberish; the pipeline is what this shows.
"""

from __future__ import annotations

import argparse

import datasets
from prompts import build_prompt, load_tickets

from batchgen_data import BatchGenMap

# 24 tickets fit in one running set; a small set keeps the KV pool small on a laptop.
ENGINE_CONFIG = {"max_num_seqs": 32}
BATCH_SIZE = 16


def main(max_tokens: int = 16, model: str = "demo") -> datasets.Dataset:
    """The tickets with ``prompt`` and the generated columns added."""
    tickets = datasets.Dataset.from_list(load_tickets())
    tickets = tickets.map(lambda row: {"prompt": build_prompt(row)})
    generate = BatchGenMap(model=model, max_tokens=max_tokens, engine_config=ENGINE_CONFIG)
    result = tickets.map(generate, batched=True, batch_size=BATCH_SIZE)
    for row in result.select(range(3)):
        print(
            f"#{row['ticket_id']} [{row['product']}] -> {row['generated_text']!r} "
            f"({row['num_generated_tokens']} tokens, {row['finish_reason']})"
        )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()
    main(args.max_tokens, args.model)
