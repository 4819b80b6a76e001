"""The pipeline-stage tests' rows: a small mixed dataset of good and bad rows, and the check of their outputs."""

from __future__ import annotations

ENGINE_CONFIG = {"max_num_seqs": 32, "attention_batch_size": 16, "max_num_batched_tokens": 512}
MAX_TOKENS = 8

GOOD_ROWS = [
    {"id": 0, "prompt": "Classify the sentiment: the blender broke after two days."},
    {"id": 1, "prompt": "Summarise: shipping took three weeks but support refunded me."},
    {"id": 2, "prompt": "Hello", "sampling_params": {"max_tokens": 3}},
    {"id": 3, "prompt": "Extract the product: I love my new espresso machine.", "sampling_params": {"max_tokens": 12, "ignore_eos": True}},
    {"id": 4, "prompt": "Translate to French: good morning", "sampling_params": {"temperature": 0.8, "seed": 7}},
    {"id": 5, "prompt": "Reply politely to: where is my order?"},
]
BAD_ROWS = [
    {"id": 100, "prompt": ""},
    {"id": 101, "prompt": None},
    {"id": 102, "prompt": "ok", "sampling_params": {"top_p": 2.0}},
    {"id": 103, "prompt": "ok", "sampling_params": {"max_tokens": 0}},
]


def mixed_rows() -> list[dict]:
    """Good and bad rows interleaved, every row with the same keys (Arrow needs one schema)."""
    rows = []
    for i, good in enumerate(GOOD_ROWS):
        rows.append(good)
        if i < len(BAD_ROWS):
            rows.append(BAD_ROWS[i])
    return [{"id": r["id"], "prompt": r["prompt"], "sampling_params": r.get("sampling_params")} for r in rows]


def check_output_rows(rows: list[dict], reference: dict) -> None:
    """Rows (as dicts) hold the reference text for good rows and an error for bad ones."""
    bad_ids = {r["id"] for r in BAD_ROWS}
    for row in rows:
        if row["id"] in bad_ids:
            assert row["finish_reason"] == "error" and row["__inference_error__"], row
            assert row["generated_text"] == "" and row["request_id"] == -1  # Ray Data LLM's error values
        else:
            ref = reference[row["id"]]
            assert row["__inference_error__"] is None, row
            assert row["generated_text"] == ref.text
            assert list(row["generated_tokens"]) == ref.token_ids
            assert row["num_input_tokens"] == ref.num_input_tokens
            assert row["num_generated_tokens"] == ref.num_generated_tokens
            assert row["finish_reason"] == ref.finish_reason
