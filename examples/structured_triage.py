"""Structured outputs: ticket triage that lands in columns, not free text.

    python examples/structured_triage.py

Classification: each answer is exactly one of the labels (``choice``). Extraction: each answer
follows a JSON schema, and the stage adds a typed ``generated_json`` column (an Arrow struct of
the schema's fields), so there is no hand-written parsing step. The demo model is random: its
answers are well formed because the constraint makes them so, not because they are right.
"""

import json
from pathlib import Path

import datasets

from batchgen_data import BatchGenMap, Engine, SamplingParams, StructuredOutputsParams
from prompts import load_tickets

DATA = Path(__file__).resolve().parent / "data"
URGENCY = ["low", "medium", "high"]


def classify(engine: Engine, tickets: list[dict]) -> list[str]:
    """One urgency label per ticket."""
    prompts = [f"Urgency of this ticket (low, medium or high)?\n{t['text']}\nUrgency:" for t in tickets]
    params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=URGENCY))
    return [out.text for out in engine.generate(prompts, params)]


def extract(tickets: list[dict], max_tokens: int = 64) -> datasets.Dataset:
    """The tickets with a typed ``generated_json`` column (and the usual output columns)."""
    schema = json.loads((DATA / "triage_schema.json").read_text())
    fn = BatchGenMap(model="demo", prompt_template=(DATA / "triage_json_prompt.txt").read_text(),
                     max_tokens=max_tokens,
                     structured_outputs={"json": schema, "disable_any_whitespace": True})
    ds = datasets.Dataset.from_list(tickets).with_format("arrow")  # Arrow batches keep the column typed
    return ds.map(fn, batched=True, batch_size=16).with_format(None)


def main() -> None:
    tickets = load_tickets()
    labels = classify(Engine("demo"), tickets)
    print("urgency:", dict(zip([t["ticket_id"] for t in tickets], labels)))
    table = extract(tickets)
    print("generated_json:", table.features["generated_json"])
    for row in table.select(range(3)):
        print(row["ticket_id"], row["finish_reason"], row["generated_json"])


if __name__ == "__main__":
    main()
