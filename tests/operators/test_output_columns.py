"""One table of output columns (issue #31): every stage and every batch format adds exactly the
columns of ``OUTPUT_TABLE`` (then ``generated_json`` for a job-wide object schema), under its types.

``build_processor`` is checked on a real Ray cluster in ``test_ray_operator.py``.
"""

from __future__ import annotations

import asyncio
import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchgen_data.operators.columns import (
    OUTPUT_COLUMNS,
    OUTPUT_SCHEMA,
    OUTPUT_TABLE,
    RowResult,
    output_schema,
)
from batchgen_data.operators.rows import StageConfig
from batchgen_data.operators.stage import finish_batch, prepare_batch
from stage_rows import ENGINE_CONFIG

from batchgen_data import BatchGenMap, BatchGenOperator
from batchgen_data.engine.outputs import GenerationOutput
from batchgen_data.engine.sample.logprobs import Logprob
from batchgen_data.jobs.cli import main

JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "stars": {"type": "integer"}}}
# A row asking for logprobs, an error row, a plain row: every column has a value and a null.
ROWS = [
    {"id": 0, "prompt": "Hello there", "sampling_params": {"max_tokens": 2, "logprobs": 1, "prompt_logprobs": 0}},
    {"id": 1, "prompt": "", "sampling_params": None},
    {"id": 2, "prompt": "Bonjour", "sampling_params": None},
]


def _fields(schema: pa.Schema, names: list[str]) -> list[tuple[str, pa.DataType]]:
    return [(name, schema.field(name).type) for name in names]


def _expected(schema: pa.Schema = OUTPUT_SCHEMA) -> list[tuple[str, pa.DataType]]:
    return [(field.name, field.type) for field in schema]


def test_the_table_is_the_one_list_of_columns():
    assert OUTPUT_COLUMNS == tuple(OUTPUT_SCHEMA.names) == tuple(c.name for c in OUTPUT_TABLE)
    assert output_schema(JSON_SCHEMA).names == [*OUTPUT_COLUMNS, "generated_json"]
    out = GenerationOutput(request_id=0, token_ids=[5, 6], text="hi", finish_reason="length", num_input_tokens=3,
                           num_generated_tokens=2, logprobs=[{5: Logprob(-0.5, 1, "h"), 7: Logprob(-1.0, 2, "x")},
                                                             {6: Logprob(-0.1, 1, "i")}])
    row = RowResult.from_output(out)
    assert list(row.values) == list(OUTPUT_COLUMNS)
    assert row.values["logprobs"][0] == [{"token_id": 5, "logprob": -0.5, "rank": 1, "decoded_token": "h"},
                                         {"token_id": 7, "logprob": -1.0, "rank": 2, "decoded_token": "x"}]
    assert (row.values["request_id"], row.values["generated_text"], row.values["prompt_token_ids"]) == (0, "hi", [])
    failed = RowResult.failed("bad row")
    assert list(failed.values) == list(OUTPUT_COLUMNS) and failed.error == "bad row"
    # Ray Data LLM 2.60's values on an error row
    assert {k: failed.values[k] for k in ("generated_text", "generated_tokens", "num_input_tokens",
                                          "num_generated_tokens", "prompt_token_ids", "request_id",
                                          "time_taken_llm", "embeddings", "metrics", "logprobs")} == {
        "generated_text": "", "generated_tokens": [], "num_input_tokens": 0, "num_generated_tokens": 0,
        "prompt_token_ids": None, "request_id": -1, "time_taken_llm": -1.0, "embeddings": None, "metrics": None,
        "logprobs": None}
    pa.table({c.name: pa.array([row.values[c.name], failed.values[c.name]], c.arrow_type) for c in OUTPUT_TABLE})


@pytest.fixture(scope="module")
def operator(demo_path):
    op = BatchGenOperator(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=2, rebalance=False)
    yield op
    op.engine.shutdown()


def _batch(fmt: str):
    table = pa.Table.from_pylist(ROWS)
    if fmt == "pyarrow":
        return table
    if fmt == "pandas":
        return table.to_pandas()
    columns = {name: [row[name] for row in ROWS] for name in ROWS[0]}
    if fmt == "dict":
        return columns
    numpy = {name: np.empty(len(ROWS), dtype=object) for name in columns}  # Ray's numpy batch
    for name, values in columns.items():
        numpy[name][:] = values
    return numpy


def _as_arrow(out, fmt: str) -> pa.Table:
    if fmt == "pyarrow":
        return out
    if fmt == "pandas":
        return pa.Table.from_pandas(out, preserve_index=False)
    columns = {name: list(values) for name, values in out.items()}
    return pa.table({name: pa.array(columns[name], OUTPUT_SCHEMA.field(name).type) for name in OUTPUT_COLUMNS})


@pytest.mark.parametrize("fmt", ["pyarrow", "pandas", "numpy", "dict"])
def test_every_batch_format_adds_the_tables_columns(operator, fmt):
    out = asyncio.run(operator(_batch(fmt)))
    names = list(out.column_names if fmt == "pyarrow" else out.keys() if fmt in ("numpy", "dict") else out.columns)
    assert names == ["id", "sampling_params", *OUTPUT_COLUMNS]
    table = _as_arrow(out, fmt)
    # the prompt the engine ran, an error row's own, and Ray's stage columns
    assert table.column("prompt").to_pylist() == ["Hello there", "", "Bonjour"]
    assert table.column("params").to_pylist()[1] == "" and table.column("params")[0].as_py().startswith(
        "SamplingParams(")
    assert len(set(table.column("batch_uuid").to_pylist())) == 1
    assert table.column("request_id").to_pylist()[1] == -1 and table.column("time_taken_llm")[1].as_py() == -1.0
    assert _fields(table.schema, list(OUTPUT_COLUMNS)) == _expected()
    assert table.column("__inference_error__").to_pylist()[1] == "RowError: empty prompt in column 'prompt'"
    assert table.column("logprobs").to_pylist()[0][0][0]["token_id"] == table.column("generated_tokens")[0][0].as_py()


def test_generated_json_comes_after_the_tables_columns():
    config = StageConfig(sampling_params={"structured_outputs": {"json": JSON_SCHEMA}})
    prepared = prepare_batch(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": ""}]), config)
    text = json.dumps({"answer": "yes", "stars": 4})
    result = RowResult.from_output(GenerationOutput(request_id=0, token_ids=[1], text=text, finish_reason="stop",
                                                    num_input_tokens=1, num_generated_tokens=1))
    out = finish_batch(prepared, [result], config)
    assert _fields(out.schema, out.column_names) == _expected(output_schema(JSON_SCHEMA))  # prompt replaced
    assert out.column("generated_json").to_pylist() == [{"answer": "yes", "stars": 4}, None]


def test_datasets_map_adds_the_tables_columns_whatever_its_first_batch_holds(demo_path):
    # The first batch is all error rows and asks for no logprobs: a dict of lists would let
    # datasets type its columns as null, and the next batch's values would fail to write.
    rows = [{"id": 10, "prompt": "", "sampling_params": None}, {"id": 11, "prompt": None, "sampling_params": None},
            *ROWS]
    fn = BatchGenMap(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=2)
    for dataset in (datasets.Dataset.from_list(rows), datasets.Dataset.from_list(rows).with_format("arrow")):
        out = dataset.map(fn, batched=True, batch_size=2)
        schema = out.features.arrow_schema
        assert schema.names == ["id", "sampling_params", *OUTPUT_COLUMNS]
        assert _fields(schema, list(OUTPUT_COLUMNS)) == _expected()
        assert out.with_format(None)["__inference_error__"][:2] == ["RowError: empty prompt in column 'prompt'",
                                                                    "RowError: missing prompt (column 'prompt' is null)"]


def test_cli_parts_have_the_tables_columns(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "schema.json").write_text(json.dumps(JSON_SCHEMA))
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--max-tokens", "2", "--max-num-seqs", "32",
                 "--json-schema", str(tmp_path / "schema.json"), "--no-progress"]) == 0
    schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
    expected = output_schema(JSON_SCHEMA)
    assert schema.names == ["id", "sampling_params", *expected.names]
    assert _fields(schema, expected.names) == _expected(expected)
