"""vLLM's structured-output options are honoured or refused, never ignored: ``whitespace_pattern``
and ``disable_additional_properties`` change the grammar (they were accepted and dropped)."""

from __future__ import annotations

import json
import re

import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams, StructuredOutputsParams
from batchgen_data.engine.structured.compiler import no_additional_properties
from batchgen_data.errors import ConfigError

OPEN_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                         "maxItems": 2}},
               "required": ["name", "tags"]}
PROMPTS = [f"Row {i}: describe the parcel in JSON." for i in range(12)]


@pytest.fixture(scope="module")
def engine(demo_path):
    return Engine(demo_path, EngineConfig(max_num_seqs=12))


def _outputs(engine, **options):
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=3,
                            structured_outputs=StructuredOutputsParams(json=OPEN_SCHEMA, **options))
    return [o for o in engine.generate(PROMPTS, [SamplingParams(**{**params.to_dict(), "seed": i})
                                                  for i in range(len(PROMPTS))])]


def test_whitespace_pattern_bounds_the_whitespace_between_json_tokens(engine):
    free = "".join(o.text for o in _outputs(engine))
    assert "\n" in free or "  " in free or "\t" in free, "the control should use flexible whitespace"
    bounded = _outputs(engine, whitespace_pattern=" ?")
    for out in bounded:
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)
        assert "\n" not in outside_strings and "  " not in outside_strings and "\t" not in outside_strings, out.text


def test_disable_additional_properties_allows_only_the_listed_ones(engine):
    assert no_additional_properties(OPEN_SCHEMA)["additionalProperties"] is False
    assert no_additional_properties({"type": "object", "additionalProperties": True})["additionalProperties"] is True
    for out in _outputs(engine, disable_additional_properties=True):
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) <= {"name", "tags"}, out.text


def test_the_options_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match="apply to json"):
        StructuredOutputsParams(regex="a+", whitespace_pattern=" ?")
    with pytest.raises(ConfigError, match="not both"):
        StructuredOutputsParams(json=OPEN_SCHEMA, whitespace_pattern=" ?", disable_any_whitespace=True)
    parsed = StructuredOutputsParams.from_value({"json": OPEN_SCHEMA, "whitespace_pattern": " ?", "backend": "xgrammar",
                                                 "disable_fallback": True, "disable_additional_properties": None})
    assert parsed.whitespace_pattern == " ?" and parsed.disable_additional_properties is False
    assert StructuredOutputsParams.from_value(parsed.to_dict()) == parsed
