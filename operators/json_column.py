"""The typed ``generated_json`` column: a structured-outputs JSON schema as an Arrow type.

Given a job-wide JSON schema for an object, every output row gets ``generated_json``: the parsed
output as an Arrow struct of the schema's properties, so answers land in columns without a
hand-written ``json.loads`` (and a row that did not produce a whole object is null, not a
silent row of nulls). Types map as:
  string -> string; integer -> int64; number -> float64; boolean -> bool;
  array -> list of its items' type; object with properties -> struct (nested);
  enum / const -> string for strings (int64 / float64 / bool when all values are of that type);
  ``["T", "null"]`` -> T (nullable);
  anything else (anyOf, oneOf, a free object, mixed types) -> string holding the value's JSON.
The value is null on error rows, on rows cut short by ``max_tokens`` (``"length"``), on rows
whose text is not JSON, and on rows whose own ``structured_outputs`` replaced the job's schema
with one whose values do not fit.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from batchgen_data.errors import ConfigError

GENERATED_JSON_COLUMN = "generated_json"
_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
# The integers a typed column's grammar allows (``bound_to_column``): int64, less the 1,023
# values at each end that llguidance cannot take as bounds (it reads them as float64, where
# 2**63 - 1 rounds up to 2**63 and the range then fails to compile).
INT64_GRAMMAR_MIN, INT64_GRAMMAR_MAX = -(2**63 - 1024), 2**63 - 1024


def json_column_type(schema: dict) -> pa.DataType:
    """The Arrow type of ``schema`` (a JSON schema for an object; see module docstring).

    Example:
        >>> json_column_type({"type": "object", "properties": {"n": {"type": "integer"}}})
        StructType(struct<n: int64>)
    """
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict) or _type_of(schema) != "object":
        raise ConfigError("a generated_json column needs a JSON schema for an object with properties")
    return _arrow_type(schema)


def bound_to_column(schema: Any) -> Any:
    """``schema`` with every value the typed column holds as int64 bounded to int64 (existing
    bounds kept where tighter), so that the grammar only allows answers the column can hold: an
    unbounded ``integer`` lets a model write 80 digits, a schema-valid answer whose column value
    would be null. Other types need no bound (a string column holds any text; an overflowing
    ``number`` is null, as any misfit).

    Example:
        >>> bound_to_column({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}})
        {'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': 0, 'maximum': 9223372036854774784}}}
    """
    if not isinstance(schema, dict) or "enum" in schema or "const" in schema:
        return schema
    kind = _type_of(schema)
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        lo = INT64_GRAMMAR_MIN if not isinstance(lo, (int, float)) else max(lo, INT64_GRAMMAR_MIN)
        hi = INT64_GRAMMAR_MAX if not isinstance(hi, (int, float)) else min(hi, INT64_GRAMMAR_MAX)
        return {**schema, "minimum": lo, "maximum": hi}
    if kind == "array" and isinstance(schema.get("items"), dict):
        return {**schema, "items": bound_to_column(schema["items"])}
    if kind == "object" and isinstance(schema.get("properties"), dict):
        return {**schema, "properties": {name: bound_to_column(sub) for name, sub in schema["properties"].items()}}
    return schema


def json_column_values(texts: list[str | None], finish_reasons: list[str | None], type_: pa.DataType) -> pa.Array:
    """The column for these rows: each ``"stop"`` row's text parsed and fitted to ``type_``."""
    values = []
    for text, reason in zip(texts, finish_reasons):
        value = None
        if reason == "stop" and text:
            try:
                value = _fit(json.loads(text), type_)
            except (json.JSONDecodeError, _Misfit, OverflowError, RecursionError):  # 400 digits for a float64, ...
                value = None
        values.append(value)
    return pa.array(values, type=type_)


def _type_of(schema: dict) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and isinstance(schema.get("properties"), dict):
        kind = "object"
    return kind if isinstance(kind, str) else None


def _arrow_type(schema: Any) -> pa.DataType:
    if not isinstance(schema, dict):
        return pa.string()
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is not None:
        return _enum_type(values)
    kind = _type_of(schema)
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array" and isinstance(schema.get("items"), dict):
        return pa.list_(_arrow_type(schema["items"]))
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return pa.struct([(name, _arrow_type(sub)) for name, sub in schema["properties"].items()])
    return pa.string()  # JSON text of whatever the value is


def _enum_type(values: list) -> pa.DataType:
    if values and all(isinstance(v, bool) for v in values):
        return pa.bool_()
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return pa.int64()
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return pa.float64()
    if all(isinstance(v, str) for v in values):
        return pa.string()
    return pa.string()  # mixed: JSON text


class _Misfit(Exception):
    """A parsed value that does not have the column's type."""


def _fit(value: Any, type_: pa.DataType) -> Any:
    """``value`` as a Python value of ``type_`` (None stays None); raises ``_Misfit``."""
    if value is None:
        return None
    if pa.types.is_struct(type_):
        if not isinstance(value, dict):
            raise _Misfit
        return {field.name: _fit(value.get(field.name), field.type) for field in type_}
    if pa.types.is_list(type_):
        if not isinstance(value, list):
            raise _Misfit
        return [_fit(v, type_.value_type) for v in value]
    if pa.types.is_boolean(type_):
        if not isinstance(value, bool):
            raise _Misfit
        return value
    if pa.types.is_int64(type_):
        if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**63:
            raise _Misfit
        return value
    if pa.types.is_float64(type_):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Misfit
        return float(value)
    # string: a string as itself, anything else (a free-form value) as its JSON text
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
