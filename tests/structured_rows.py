"""Rows with structured outputs for the pipeline-stage tests, and the checks of their outputs.

The demo model is random: only the constraint can make its outputs well formed.
"""

from __future__ import annotations

import json
import re

import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "mixed"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "refund": {"type": "boolean"},
        "topics": {"type": "array", "items": {"type": "string", "enum": ["food", "service", "price"]}, "maxItems": 3},
    },
    "required": ["sentiment", "stars", "refund", "topics"],
    "additionalProperties": False,
}
CHOICE = ["positive", "negative", "mixed"]
REGEX = r"[A-Z]{3}-[0-9]{2}"
MAX_TOKENS = 48


def guided_rows() -> list[dict]:
    """Rows as a Ray Data LLM user writes them: ``guided_decoding`` in each row's
    ``sampling_params`` (the JSON schema as text, so every row's struct has one type)."""
    kinds = [{"choice": CHOICE}, {"regex": REGEX}, {"json": json.dumps(SCHEMA), "disable_any_whitespace": True},
             {"regex": "a(b"}]
    rows = []
    for i in range(8):
        kind = kinds[i % len(kinds)]
        guided = {"choice": None, "regex": None, "json": None, "disable_any_whitespace": None, **kind}
        rows.append({"id": i, "prompt": f"Review {i}: the soup was {'cold' if i % 2 else 'great'}.",
                     "sampling_params": {"max_tokens": MAX_TOKENS, "guided_decoding": guided}})
    return rows


def check_guided_rows(rows: list[dict]) -> None:
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == list(range(8))
    for i, row in by_id.items():
        text, kind = row["generated_text"], i % 4
        if kind == 3:
            assert row["finish_reason"] == "error" and "unclosed group" in row["__inference_error__"]
            continue
        assert row["finish_reason"] == "stop" and row["__inference_error__"] is None, row
        if kind == 0:
            assert text in CHOICE
        elif kind == 1:
            assert re.fullmatch(REGEX, text)
        else:
            jsonschema.validate(json.loads(text), SCHEMA)


def check_generated_json(rows: list[dict]) -> None:
    """``generated_json`` holds the parsed object where the row finished with "stop", else null."""
    assert any(r["finish_reason"] == "stop" for r in rows)
    for row in rows:
        value = row["generated_json"]
        if row["finish_reason"] == "stop":
            assert value == json.loads(row["generated_text"]), row
            jsonschema.validate(value, SCHEMA)
        else:
            assert value is None, row
