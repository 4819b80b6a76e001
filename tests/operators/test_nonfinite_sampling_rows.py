"""NaN and infinities in sampling values are the same clear error in every pipeline entry point
(issue #50, finding 9): a row's ``sampling_params`` (a NaN is a value, not a null: it used to
run with the defaults), ``StageConfig`` / ``BatchGenMap`` defaults, and every row error is one
line."""

from __future__ import annotations

import math

import datasets
import pyarrow as pa
import pytest
from batchgen_data.operators.columns import ERROR_COLUMN, RowResult
from batchgen_data.operators.rows import StageConfig, prepare_rows

from batchgen_data import BatchGenMap
from batchgen_data.errors import ConfigError

ROWS = [
    {"id": 0, "prompt": "Hello", "sampling_params": {"temperature": math.nan, "top_p": None}},
    {"id": 1, "prompt": "Hello", "sampling_params": {"temperature": None, "top_p": math.nan}},
    {"id": 2, "prompt": "Hello", "sampling_params": {"temperature": math.inf, "top_p": None}},
    {"id": 3, "prompt": "Hello", "sampling_params": {"temperature": None, "top_p": None}},  # the defaults
    {"id": 4, "prompt": "Hello", "sampling_params": None},
]
ERRORS = [
    "RowError: invalid sampling_params: temperature must be a finite number, got nan",
    "RowError: invalid sampling_params: top_p must be a finite number, got nan",
    "RowError: invalid sampling_params: temperature must be a finite number, got inf",
    None,
    None,
]


def test_a_rows_nan_or_infinite_sampling_value_is_an_error_row_and_a_null_is_the_default():
    table = pa.Table.from_pylist(ROWS)  # Arrow keeps NaN apart from null
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    rows = prepare_rows(columns, len(ROWS), StageConfig(sampling_params={"max_tokens": 2}))
    assert [row.error for row in rows] == ERRORS
    pandas_rows = prepare_rows({k: list(v) for k, v in table.to_pandas().to_dict("list").items()}, len(ROWS),
                               StageConfig(sampling_params={"max_tokens": 2}))  # pandas: a struct's null fields are None
    assert [row.error for row in pandas_rows] == ERRORS


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=str)
def test_a_non_finite_stage_default_is_a_config_error(field, value):
    message = f"^{field} must be a finite number, got {value}$"
    with pytest.raises(ConfigError, match=message):
        StageConfig.from_kwargs(**{field: value})
    with pytest.raises(ConfigError, match=message):
        BatchGenMap(model="demo", **{field: value})


def test_batchgen_map_rows_with_nan_are_error_rows(demo_path):
    ds = datasets.Dataset.from_list(ROWS)
    fn = BatchGenMap(model=str(demo_path), engine_config={"max_num_seqs": 8}, max_tokens=2)
    out = ds.map(fn, batched=True, batch_size=8).to_list()
    assert [row[ERROR_COLUMN] for row in out] == ERRORS
    assert [row["num_generated_tokens"] for row in out[3:]] == [2, 2]


def test_every_row_error_is_one_line():
    result = RowResult.failed("panic: assertion failed: x < 10\nstack backtrace:\n   0: <unknown>\n   1: main")
    assert result.error == "panic: assertion failed: x < 10"
    assert RowResult.failed("invalid regex: a(b\n   ^\nunclosed group").error == "invalid regex: a(b ^ unclosed group"
