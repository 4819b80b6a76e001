"""A job-wide schema that makes a typed ``generated_json`` column also bounds its grammar to what
the column holds: an ``integer`` cannot run past int64 (issue #36, item 3: the demo model wrote
80 digits for a priority, a schema-valid answer whose column value came out null)."""

import json

import pyarrow as pa
import pytest

from batchgen_data.engine.structured.compiler import GrammarCompiler
from batchgen_data.engine.structured.params import StructuredOutputsParams
from batchgen_data.operators.json_column import (
    INT64_GRAMMAR_MAX,
    INT64_GRAMMAR_MIN,
    bound_to_column,
    json_column_type,
    json_column_values,
)
from batchgen_data.operators.rows import StageConfig
from batchgen_data.operators.stage import stage_output_schema

SCHEMA = {"type": "object", "properties": {
    "priority": {"type": "integer"},
    "score": {"type": ["integer", "null"], "minimum": -5, "maximum": 10**30},
    "codes": {"type": "array", "items": {"type": "integer"}},
    "owner": {"type": "object", "properties": {"id": {"type": "integer", "exclusiveMinimum": 0}}},
    "level": {"enum": [1, 2, 3]},
    "name": {"type": "string"},
    "ratio": {"type": "number"},
}, "required": ["priority"]}


def test_every_int64_value_of_the_column_is_bounded_and_nothing_else_changes():
    bounded = bound_to_column(SCHEMA)
    props = bounded["properties"]
    assert props["priority"] == {"type": "integer", "minimum": INT64_GRAMMAR_MIN, "maximum": INT64_GRAMMAR_MAX}
    assert (props["score"]["minimum"], props["score"]["maximum"]) == (-5, INT64_GRAMMAR_MAX)  # tighter kept
    assert props["codes"]["items"]["maximum"] == INT64_GRAMMAR_MAX
    assert props["owner"]["properties"]["id"]["exclusiveMinimum"] == 0
    assert props["owner"]["properties"]["id"]["minimum"] == INT64_GRAMMAR_MIN
    for name in ("level", "name", "ratio"):
        assert props[name] == SCHEMA["properties"][name]
    assert SCHEMA["properties"]["priority"] == {"type": "integer"}  # the caller's schema is not modified
    assert json_column_type(bounded) == json_column_type(SCHEMA)


def test_the_stage_config_bounds_its_default_schema_and_keeps_the_column_type():
    config = StageConfig(sampling_params={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    constraint = config.default_params().structured_outputs
    assert constraint.json["properties"]["priority"]["maximum"] == INT64_GRAMMAR_MAX
    assert constraint.disable_any_whitespace
    assert stage_output_schema(config).field("generated_json").type == json_column_type(SCHEMA)
    # A schema without a typed column (not an object) is left as it was.
    plain = StageConfig(sampling_params={"structured_outputs": {"json": {"type": "integer"}}}).default_params().structured_outputs
    assert plain.json == {"type": "integer"}


@pytest.fixture(scope="module")
def compiler(demo_path):
    from batchgen_data.model import ModelConfig
    from batchgen_data.engine.tokenizer import PromptTokenizer

    config = ModelConfig.from_pretrained(demo_path)
    tokenizer = PromptTokenizer(demo_path, config.vocab_size, config.eos_token_ids)
    compiler = GrammarCompiler(demo_path, config.vocab_size, frozenset(config.eos_token_ids))
    yield compiler, tokenizer
    compiler.close()


@pytest.mark.parametrize("value, allowed", [
    (0, True), (INT64_GRAMMAR_MAX, True), (INT64_GRAMMAR_MIN, True), (-7, True),
    (2**63 - 1, False), (2**63, False), (-(2**63) - 1, False), (10**79, False),
])
def test_the_bounded_grammar_takes_an_integer_exactly_when_the_column_can(compiler, value, allowed):
    """The library's own token-by-token verdict on each answer (``consume_tokens``)."""
    compiler, tokenizer = compiler
    schema = {"type": "object", "properties": {"priority": {"type": "integer"}}, "required": ["priority"],
              "additionalProperties": False}
    params = StructuredOutputsParams(json=bound_to_column(schema), disable_any_whitespace=True)
    matcher = compiler.submit(params).result(timeout=60).new_matcher()
    text = json.dumps({"priority": value}, separators=(",", ":"))
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    accepted = matcher.consume_tokens(ids) and matcher.is_accepting()
    assert accepted == allowed


def test_a_number_too_large_for_float64_is_a_null_value_not_a_failed_batch():
    type_ = json_column_type({"type": "object", "properties": {"ratio": {"type": "number"}}})
    column = json_column_values(['{"ratio": 1' + "0" * 400 + "}", '{"ratio": 2.5}'], ["stop", "stop"], type_)
    assert column.to_pylist() == [None, {"ratio": 2.5}]
    assert column.type == type_ and isinstance(column, pa.StructArray)
