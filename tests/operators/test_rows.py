"""Row bookkeeping and batch formats, without a cluster."""

from __future__ import annotations

import asyncio

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from batchgen_data.operators import OUTPUT_COLUMNS
from batchgen_data.operators.batch_format import OUTPUT_SCHEMA, with_output_columns
from batchgen_data.operators.rows import INPUT_ERROR_COLUMN, RowError, StageConfig, prepare_rows
from stage_rows import ENGINE_CONFIG, MAX_TOKENS, check_output_rows, mixed_rows

from batchgen_data import BatchGenMap, BatchGenOperator


def test_output_schema_names_the_output_columns():
    assert tuple(OUTPUT_SCHEMA.names) == OUTPUT_COLUMNS


def test_prepare_rows_turns_bad_rows_into_errors():
    rows = mixed_rows()
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    prepared = prepare_rows(columns, len(rows), StageConfig(sampling_params={"max_tokens": 5}))
    errors = {rows[p.index]["id"]: p.error for p in prepared if p.error}
    assert set(errors) == {100, 101, 102, 103}
    assert "empty prompt" in errors[100] and "missing prompt" in errors[101]
    assert "top_p" in errors[102] and "max_tokens" in errors[103]
    good = [p for p in prepared if p.error is None]
    assert all(p.params.max_tokens in (5, 3, 12) for p in good)


def test_reader_errors_and_json_columns_reach_row_validation():
    columns = {
        "prompt": ["ok", None, "ok", "ok", "ok"],
        "sampling_params": ['{"max_tokens": 3}', None, '"max_tokens=3"', "{not json", None],
        INPUT_ERROR_COLUMN: [None, "in.jsonl line 2: invalid JSON at column 9: Expecting value", None, None, None],
    }
    prepared = prepare_rows(columns, 5, StageConfig(sampling_params={"max_tokens": 5}, json_columns=["sampling_params"]))
    assert prepared[0].error is None and prepared[0].params.max_tokens == 3  # decoded, then applied
    assert prepared[1].error == "RowError: in.jsonl line 2: invalid JSON at column 9: Expecting value"
    assert prepared[2].error == "RowError: sampling_params must be a dict, got str"
    assert prepared[3].error.startswith("RowError: column 'sampling_params' should hold JSON text but holds '{not json'")
    assert prepared[4].error is None and prepared[4].params.max_tokens == 5
    # A batch whose every row the reader rejected needs no prompt column.
    only_errors = prepare_rows({INPUT_ERROR_COLUMN: ["bad line"]}, 1, StageConfig())
    assert [p.error for p in only_errors] == ["RowError: bad line"]
    with pytest.raises(ValueError, match="json_columns must be a list of column names, got 'sampling_params'"):
        StageConfig(json_columns="sampling_params")


def test_each_row_reads_the_first_prompt_column_it_has():
    # Rows of files with different prompt columns share batches (and, in a CLI job, columns).
    messages = [{"role": "user", "content": "Hi"}]
    columns = {"prompt": ["text", None, None], "messages": [None, messages, None]}
    prepared = prepare_rows(columns, 3, StageConfig())
    assert [p.prompt for p in prepared[:2]] == ["text", messages]
    assert prepared[2].error == "RowError: missing prompt (columns 'messages', 'prompt' are all null)"


def test_without_the_chat_template_stage_rows_run_their_prompt_or_token_ids():
    """Ray Data LLM with ``chat_template_stage=False``: rows carry ``prompt`` or
    ``tokenized_prompt`` (a batch of token-id rows used to fail whole: ``prompt_column 'prompt'
    not in the batch columns``), and ``messages`` are not read."""
    from batchgen_data import BatchGenProcessorConfig

    kwargs = BatchGenProcessorConfig(model_source="demo", chat_template_stage=False).operator_kwargs()
    assert kwargs["apply_chat_template"] is False and "prompt_column" not in kwargs
    config = StageConfig(apply_chat_template=False)
    token_rows = prepare_rows({"tokenized_prompt": [[5, 6, 7], [8, 9]]}, 2, config)
    assert [p.prompt for p in token_rows] == [[5, 6, 7], [8, 9]]
    messages = [{"role": "user", "content": "Hi"}]
    mixed = prepare_rows({"messages": [messages], "prompt": ["raw text"]}, 1, config)
    assert mixed[0].prompt == "raw text"


def test_messages_replace_prompt_and_token_ids_win_as_in_ray_data_llm():
    """Ray Data LLM renders ``messages`` and overwrites ``prompt`` (its quickstart's rows carry
    both), and runs ``tokenized_prompt`` when a row has it: a row with both used to run the raw
    ``prompt``, without the chat template."""
    messages = [{"role": "user", "content": "Hi"}]
    columns = {"prompt": ["raw text", "raw text", "raw text"], "messages": [messages, None, None],
               "tokenized_prompt": [None, [5, 6, 7], None]}
    prepared = prepare_rows(columns, 3, StageConfig())
    assert [p.prompt for p in prepared] == [messages, [5, 6, 7], "raw text"]


@pytest.mark.parametrize("fmt", ["pyarrow", "pandas", "numpy", "dict"])
def test_the_reader_error_column_is_not_passed_through(fmt):
    table = pa.table({"prompt": ["a"], INPUT_ERROR_COLUMN: pa.array(["bad line"], pa.string())})
    batch = {"pyarrow": table, "pandas": table.to_pandas(), "dict": table.to_pydict(),
             "numpy": {k: np.array(v, dtype=object) for k, v in table.to_pydict().items()}}[fmt]
    added = {name: [None] for name in OUTPUT_COLUMNS}
    out = with_output_columns(batch, added)
    names = out.column_names if fmt == "pyarrow" else list(out.columns if fmt == "pandas" else out)
    assert INPUT_ERROR_COLUMN not in names and "prompt" in names and set(OUTPUT_COLUMNS) <= set(names)


def test_missing_prompt_column_is_a_config_error():
    with pytest.raises(ValueError, match="none of the prompt columns"):
        prepare_rows({"text": ["a"]}, 1, StageConfig())
    with pytest.raises(ValueError, match="temperature"):
        StageConfig(sampling_params={"temperature": -1.0})


@pytest.fixture(scope="module")
def operator(demo_path):
    op = BatchGenOperator(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=MAX_TOKENS)
    yield op
    op.engine.shutdown()


@pytest.mark.parametrize("fmt", ["pyarrow", "pandas", "numpy"])
def test_operator_call_in_every_batch_format(operator, reference_outputs, fmt):
    rows = mixed_rows()
    table = pa.Table.from_pylist(rows)
    batch = {"pyarrow": table, "pandas": table.to_pandas(), "numpy": {k: np.array([r[k] for r in rows], dtype=object) if k != "id" else np.array([r[k] for r in rows]) for k in rows[0]}}[fmt]
    out = asyncio.run(operator(batch))
    if fmt == "pyarrow":
        assert isinstance(out, pa.Table) and out.schema.field("generated_tokens").type == pa.list_(pa.int64())
        out_rows = out.to_pylist()
    elif fmt == "pandas":
        assert isinstance(out, pd.DataFrame)
        out_rows = [{k: (None if v is pd.NA else v) for k, v in r.items()} for r in out.to_dict("records")]
    else:
        assert isinstance(out, dict) and all(isinstance(v, np.ndarray) for v in out.values())
        out_rows = [{k: out[k][i] for k in out} for i in range(len(rows))]
    assert [r["id"] for r in out_rows] == [r["id"] for r in rows]  # one row per row, in order
    assert all(set(OUTPUT_COLUMNS) <= set(r) for r in out_rows)
    check_output_rows(out_rows, reference_outputs)


def test_should_continue_on_error_false_raises(demo_path):
    op = BatchGenOperator(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=MAX_TOKENS,
                          should_continue_on_error=False)
    try:
        with pytest.raises(RowError, match="empty prompt"):
            asyncio.run(op(pa.Table.from_pylist([{"prompt": "fine"}, {"prompt": ""}])))
    finally:
        op.engine.shutdown()


def test_datasets_map_callable_pickles_as_config(demo_path):
    import pickle

    fn = BatchGenMap(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=MAX_TOKENS)
    blob = pickle.dumps(fn)
    assert len(blob) < 2000  # the config, never weights
    assert pickle.dumps(pickle.loads(blob)) == blob


@pytest.mark.parametrize("fmt", ["pyarrow", "numpy", "dict"])
def test_logprob_columns_in_every_batch_format(operator, fmt):
    """Rows asking for logprobs get Ray Data LLM's per-position dicts in Ray's numpy batches, and
    the same entries as lists (with their token_id) where the batch is Arrow-shaped; the other
    rows get nulls."""
    from batchgen_data.operators.batch_format import LOGPROBS_TYPE

    rows = [{"prompt": "Hello there", "sampling_params": {"logprobs": 2, "prompt_logprobs": 1, "max_tokens": 3}},
            {"prompt": "Bonjour", "sampling_params": None}]
    table = pa.Table.from_pylist(rows)
    batch = {"pyarrow": table, "numpy": {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]},
             "dict": {k: [r[k] for r in rows] for k in rows[0]}}[fmt]
    out = asyncio.run(operator(batch))
    if fmt == "pyarrow":
        assert out.schema.field("logprobs").type == LOGPROBS_TYPE
        out_rows = out.to_pylist()
    else:
        out_rows = [{k: out[k][i] for k in out} for i in range(2)]
    asked, plain = out_rows

    def as_dict(position):  # the column's entries keyed by token id (Ray Data LLM's form)
        return {e["token_id"]: {k: e[k] for k in ("logprob", "rank", "decoded_token")} for e in position}

    # one form in every batch format: the Arrow column's
    pa.array([asked["logprobs"], plain["logprobs"]], LOGPROBS_TYPE)
    logprobs = [as_dict(p) for p in asked["logprobs"]]
    assert len(logprobs) == asked["num_generated_tokens"] == 3
    for token, entry in zip(asked["generated_tokens"], logprobs):
        assert next(iter(entry)) == token and len(entry) in (2, 3)
        assert set(entry[token]) == {"logprob", "rank", "decoded_token"} and entry[token]["logprob"] <= 0
    assert asked["prompt_logprobs"][0] is None and len(asked["prompt_logprobs"]) == asked["num_input_tokens"]
    assert plain["logprobs"] is None and plain["prompt_logprobs"] is None
