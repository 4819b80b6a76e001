"""The typed ``generated_json`` column and the rows' structured-outputs parameters, without a model."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from batchgen_data.operators.json_column import json_column_type, json_column_values
from batchgen_data.operators.rows import StageConfig, prepare_rows

from batchgen_data.errors import ConfigError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": ["number", "null"]},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver"]},
        "level": {"enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
        "extra": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    },
}


def test_schema_maps_to_arrow_types():
    assert json_column_type(SCHEMA) == pa.struct([
        ("name", pa.string()), ("age", pa.int64()), ("height", pa.float64()), ("member", pa.bool_()),
        ("tier", pa.string()), ("level", pa.int64()), ("tags", pa.list_(pa.string())),
        ("address", pa.struct([("city", pa.string()), ("zip", pa.int64())])), ("extra", pa.string()),
    ])
    for not_an_object in ({"type": "array", "items": {"type": "string"}}, {"type": "object"}, {"type": "string"}):
        with pytest.raises(ConfigError, match="object with properties"):
            json_column_type(not_an_object)


def test_values_are_typed_and_null_where_the_row_gave_no_object():
    type_ = json_column_type(SCHEMA)
    good = {"name": "Ada", "age": 36, "height": 1, "member": True, "tier": "gold", "level": 2, "tags": ["x"],
            "address": {"city": "Paris"}, "extra": 7}
    texts = [json.dumps(good), json.dumps(good)[:-3], "not json", json.dumps({"age": "old"}), json.dumps(good), None]
    reasons = ["stop", "length", "stop", "stop", "error", "error"]
    column = json_column_values(texts, reasons, type_)
    assert column.type == type_
    first = column[0].as_py()
    assert first["height"] == 1.0 and isinstance(first["height"], float)  # an integral number is still a float
    assert first["address"] == {"city": "Paris", "zip": None} and first["extra"] == "7"  # free-form: JSON text
    assert column.to_pylist()[1:] == [None] * 5  # cut short, not JSON, misfit, error rows


def test_rows_take_guided_decoding_and_override_the_stage_default():
    default = {"json": {"type": "object", "properties": {"a": {"type": "string"}}}}
    columns = {
        "prompt": ["p"] * 5,
        "sampling_params": [
            None,
            {"guided_decoding": {"choice": ["x", "y"], "regex": None, "json": None}},
            {"structured_outputs": {"regex": "[0-9]+"}},
            {"guided_decoding": {"choice": ["x"], "regex": "[0-9]"}},
            # as Arrow gives a schema of a struct column: keys other rows' schemas have, as null
            {"guided_decoding": {"json": {"type": "object", "properties": {"b": {"type": "integer", "enum": None}},
                                          "required": None}}},
        ],
    }
    rows = prepare_rows(columns, 5, StageConfig(sampling_params={"structured_outputs": default}))
    assert rows[0].params.structured_outputs.json == default["json"]
    assert rows[1].params.structured_outputs.choice == ("x", "y")
    assert rows[2].params.structured_outputs.regex == "[0-9]+"
    assert "exactly one" in rows[3].error
    assert rows[4].params.structured_outputs.json == {"type": "object", "properties": {"b": {"type": "integer"}}}
