"""Random JSON at every input column, through the row layer and the engine (issue #31).

Each example is one batch: a few rows whose ``prompt``, ``messages``, ``prompt_token_ids``,
``tokenized_prompt`` and ``sampling_params`` hold random JSON values (any Unicode, lone
surrogates included, nested objects and lists, huge numbers, NaN, null, bools), plausible values
(message lists, token ids, real sampling fields and ``structured_outputs`` / ``guided_decoding``
constraints) and mixes of both, then one valid row. The batch goes through the stages' shared
row code (``prepare_batch``, ``Engine.generate``, ``finish_batch``: what ``BatchGenMap`` runs)
on the demo model, as a dict of lists or as Ray's numpy batch. Every row must come out, in
order, as a result or as an error row naming the problem; the output must be valid Arrow of the
output schema; and the valid row after the fuzzed ones must still generate.

Derandomized (the same examples on every run); ``-s`` prints how many ran.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import pytest
from batchgen_data.operators.columns import ERROR_COLUMN, OUTPUT_SCHEMA, RowResult
from batchgen_data.operators.rows import PROMPT_COLUMNS, StageConfig
from batchgen_data.operators.stage import finish_batch, prepare_batch
from batchgen_data.operators.surrogates import find_lone_surrogate
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from stage_rows import ENGINE_CONFIG

from batchgen_data import Engine, EngineConfig, SamplingParams

MAX_TOKENS = 2  # every generated row stops here: the fuzz is about rows, not generation
NUM_EXAMPLES = 400  # ~10 s on an idle 2-core machine, ~35 s on a busy one; 6,000 random ones pass too
CONFIG = StageConfig(sampling_params={"max_tokens": MAX_TOKENS})

# --- strategies -------------------------------------------------------------------------------

LONE_SURROGATES = st.sampled_from(["\ud83d", "\ude00", "\ud800", "\udbff", "\udc80", "\udfff"])
TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=12),  # any code point
    st.builds(lambda head, half, tail: head + half + tail, st.text(max_size=6), LONE_SURROGATES,
              st.text(max_size=6)),
    st.sampled_from(["Hello", "", "   ", "Summarise: the kettle leaks.", "\U0001f600", "a\x00b"]),
)
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)  # valid text, mostly a prompt
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant"]), TEXT, JSON), "content": TEXT | JSON},
        optional={"name": JSON}),
    max_size=3)
TOKEN_IDS = st.one_of(st.lists(st.integers(0, 151_000), min_size=1, max_size=6),
                      st.lists(st.integers(), max_size=4), st.lists(JSON, max_size=3))
SCHEMAS = st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "integer", "array", "nonsense"]) | JSON},
    optional={"properties": st.dictionaries(TEXT, st.fixed_dictionaries({"type": st.sampled_from(
        ["string", "integer", "boolean"])}) | JSON, max_size=2), "required": JSON, "enum": JSON})
CONSTRAINTS = st.one_of(
    JSON,
    st.fixed_dictionaries({}, optional={
        "json": SCHEMAS | JSON | TEXT, "regex": st.sampled_from(["[ab]+", "(", "\\d{2}"]) | TEXT,
        "choice": st.lists(TEXT, max_size=3) | JSON, "grammar": st.sampled_from(["root ::= \"yes\"", "start: "]) | TEXT,
        "json_object": JSON, "disable_any_whitespace": JSON, "backend": JSON}),
)
# Each field: values in its valid range first (they reach the engine), then anything.
SAMPLING_VALUES = {
    "max_tokens": st.integers(1, MAX_TOKENS) | st.integers() | st.floats() | JSON,
    "temperature": st.floats(0, 1e6) | st.floats() | st.integers() | JSON,
    "top_p": st.floats(0, 1, exclude_min=True) | st.floats() | JSON,
    "top_k": st.integers(-1, 1 << 40) | st.integers() | JSON,
    "seed": st.integers() | JSON,
    "stop": st.lists(WORDS, max_size=2) | TEXT | JSON,
    "stop_token_ids": st.lists(st.integers(0, 1 << 62), max_size=3) | st.lists(st.integers(), max_size=3) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "skip_special_tokens": st.booleans() | JSON,
    "logprobs": st.integers(0, 20) | st.integers(-1, 21) | JSON,
    "prompt_logprobs": st.integers(0, 20) | st.integers(-1, 21) | JSON,
    "structured_outputs": CONSTRAINTS,
    "guided_decoding": CONSTRAINTS,
    "presence_penalty": st.floats(-2, 2) | st.floats() | JSON,
    "frequency_penalty": st.floats(-2, 2) | st.floats() | JSON,
    "repetition_penalty": st.floats(0.1, 3) | st.floats() | JSON,
    "min_p": st.floats(0, 1) | st.floats() | JSON,
    "min_tokens": st.integers(0, MAX_TOKENS) | st.integers() | JSON,
    "logit_bias": st.dictionaries(st.integers(0, 151_000) | st.integers(0, 151_000).map(str), st.floats(-200, 200),
                                  max_size=3) | st.dictionaries(TEXT, JSON, max_size=2) | JSON,
    "allowed_token_ids": st.lists(st.integers(0, 151_000), min_size=1, max_size=4) | st.lists(st.integers(), max_size=3)
    | JSON,
    "bad_words": st.lists(WORDS, max_size=2) | JSON,
}
SAMPLING_PARAMS = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(sorted(SAMPLING_VALUES)), st.none(), max_size=3).flatmap(
        lambda keys: st.fixed_dictionaries({k: SAMPLING_VALUES[k] for k in keys})),
    st.dictionaries(TEXT, JSON, max_size=2),
)
COLUMNS = {
    "prompt": WORDS | TEXT | JSON,
    "messages": MESSAGES | JSON,
    "prompt_token_ids": TOKEN_IDS | JSON,
    "tokenized_prompt": TOKEN_IDS | JSON,
    "sampling_params": SAMPLING_PARAMS,
}
ROWS = st.lists(st.fixed_dictionaries({}, optional=COLUMNS), min_size=1, max_size=4)


def _tame(row: dict) -> dict:
    """Keep generation tiny: a numeric ``max_tokens`` above ``MAX_TOKENS`` becomes ``MAX_TOKENS``."""
    params = row.get("sampling_params")
    if not isinstance(params, dict):
        return row
    params = dict(params)
    value = params.get("max_tokens")
    if _is_number(value) and not value <= MAX_TOKENS:
        params["max_tokens"] = MAX_TOKENS
    return {**row, "sampling_params": params}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- the property -----------------------------------------------------------------------------

VALID_ROW = {"prompt": "Hello"}
counts = {"batches": 0, "rows": 0, "results": 0, "error_rows": 0, "surrogate_rows": 0}


@pytest.fixture(scope="module")
def engine(demo_path):
    engine = Engine(demo_path, EngineConfig(**ENGINE_CONFIG))
    started = time.perf_counter()
    yield engine
    print(f"\nrow fuzz: {counts['batches']} batches, {counts['rows']} fuzzed rows ({counts['results']} results, "
          f"{counts['error_rows']} error rows, {counts['surrogate_rows']} with a lone surrogate where it is "
          f"read) in {time.perf_counter() - started:.1f}s")
    engine.close()


def _batch(rows: list[dict], fmt: str) -> dict:
    names = ["id", *dict.fromkeys(k for row in rows for k in row if k != "id")]
    columns = {name: [row.get(name) for row in rows] for name in names}
    if fmt == "dict":
        return columns
    numpy = {}
    for name, values in columns.items():  # Ray's numpy batches: object arrays of the rows' values
        numpy[name] = np.empty(len(values), dtype=object)
        numpy[name][:] = values
    numpy["id"] = np.asarray(columns["id"], dtype=np.int64)
    return numpy


def _stage(batch, engine: Engine):
    """What ``BatchGenMap`` does with a batch, on this module's engine."""
    prepared = prepare_batch(batch, CONFIG)
    outputs = engine.generate(prepared.prompts, prepared.params) if prepared.valid_rows else []
    return finish_batch(prepared, [RowResult.from_output(out) for out in outputs], CONFIG)


def _read_value(row: dict):
    """The value the row layer reads as the row's prompt: its first prompt column not null."""
    for name in PROMPT_COLUMNS:
        value = row.get(name)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            return value
    return None


@settings(max_examples=NUM_EXAMPLES, phases=[Phase.explicit, Phase.generate, Phase.shrink], deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(rows=ROWS, fmt=st.sampled_from(["dict", "numpy"]))
def test_every_row_comes_out_as_a_result_or_an_error_row(engine, rows, fmt):
    rows = [{"id": i, **_tame(row)} for i, row in enumerate(rows)]
    rows.append({"id": len(rows), **VALID_ROW})
    out = _stage(_batch(rows, fmt), engine)

    assert [int(i) for i in out["id"]] == [row["id"] for row in rows]  # every row, in order
    for name in OUTPUT_SCHEMA.names:
        values = list(out[name])
        pa.array(values, type=OUTPUT_SCHEMA.field(name).type)  # valid text, the column's type
    for i, row in enumerate(rows):
        error, reason = out[ERROR_COLUMN][i], out["finish_reason"][i]
        if error is None:
            assert reason in ("stop", "length") and isinstance(out["generated_text"][i], str), row
            assert 1 <= out["num_generated_tokens"][i] <= MAX_TOKENS, row
        else:
            assert isinstance(error, str) and error.strip() and reason == "error", row
            assert out["generated_text"][i] == "", row
        params = row.get("sampling_params")
        has_surrogate = find_lone_surrogate(_read_value(row)) is not None or (
            isinstance(params, dict) and find_lone_surrogate(params) is not None)
        assert error is not None or not has_surrogate, row  # (the first problem found is named)
        counts["surrogate_rows"] += has_surrogate and i < len(rows) - 1
    assert out[ERROR_COLUMN][-1] is None and out["num_generated_tokens"][-1] >= 1  # the engine still runs
    counts["batches"] += 1
    counts["rows"] += len(rows) - 1
    errors = sum(error is not None for error in list(out[ERROR_COLUMN])[:-1])
    counts["error_rows"] += errors
    counts["results"] += len(rows) - 1 - errors


def test_stop_strings_and_messages_with_a_lone_surrogate_are_error_rows(engine):
    """The surrogate cases named in issue #31, one of each, with the column and place named."""
    rows = [
        {"id": 0, "prompt": "broken emoji \ud83d here"},
        {"id": 1, "messages": [{"role": "user", "content": "hi \ude00"}]},
        {"id": 2, "prompt": "Hello", "sampling_params": {"stop": ["ok", "\ud83d"]}},
        {"id": 3, "prompt": "Hello", "sampling_params": {"guided_decoding": {"choice": ["a\udfff"]}}},
        {"id": 4, "prompt_token_ids": [9707, "\ud800"]},
        {"id": 5, **VALID_ROW},
    ]
    out = _stage(_batch(rows, "dict"), engine)
    problem = "holds a lone surrogate {} (half of a UTF-16 pair, such as a cut emoji): text must be valid Unicode"
    assert out[ERROR_COLUMN][:5] == [
        "RowError: column 'prompt' " + problem.format("\\ud83d"),
        "RowError: column 'messages[0].content' " + problem.format("\\ude00"),
        "RowError: column 'sampling_params.stop[1]' " + problem.format("\\ud83d"),
        "RowError: column 'sampling_params.guided_decoding.choice[0]' " + problem.format("\\udfff"),
        "RowError: column 'prompt_token_ids[1]' " + problem.format("\\ud800"),
    ]
    assert out[ERROR_COLUMN][5] is None and out["generated_text"][5]


def test_a_stage_default_with_a_lone_surrogate_is_a_config_error():
    from batchgen_data.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'stop\[0\]' holds a lone surrogate \\ud83d"):
        StageConfig(sampling_params={"stop": ["\ud83d"]})
    with pytest.raises(ConfigError, match=r"'structured_outputs.choice\[1\]' holds a lone surrogate"):
        StageConfig.from_kwargs(structured_outputs={"choice": ["yes", "no\udc00"]})
    assert SamplingParams(stop=["\U0001f600"]).stop == ["\U0001f600"]  # a whole emoji is text
