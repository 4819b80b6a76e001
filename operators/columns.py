"""The output columns: one table, from which every stage, batch format and the CLI take theirs.

Every output row has every column of ``OUTPUT_TABLE``, in its order (``__inference_error__``
null on success), so every batch, and every Parquet part of a job, has one schema. Each entry
gives the column's Arrow type, its value for an engine output, and its value on a row that never
reached the engine (a bad row). With a job-wide JSON schema for an object, the typed
``generated_json`` column follows them (``output_schema``; its type and values: ``json_column.py``).

Logprobs go from the engine's output (one ``{token_id: Logprob}`` per position) to their column
form once, here: per position, a list of ``{token_id, logprob, rank, decoded_token}`` entries,
the token that was there first (datasets and Parquet have no map type). Ray's numpy batches show
them as Ray Data LLM's rows do, ``{token_id: {logprob, rank, decoded_token}}`` per position
(``OutputColumn.ray_llm_form``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import pyarrow as pa
from batchgen_data.operators.json_column import (
    GENERATED_JSON_COLUMN,
    json_column_type,
    json_column_values,
)
from batchgen_data.operators.surrogates import escape_lone_surrogates

from batchgen_data.engine.outputs import GenerationOutput
from batchgen_data.engine.sample.logprobs import Logprob

ERROR_COLUMN = "__inference_error__"
LOGPROB_ENTRY = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
                           ("decoded_token", pa.string())])
LOGPROBS_TYPE = pa.list_(pa.list_(LOGPROB_ENTRY))


@dataclass(slots=True, frozen=True)
class OutputColumn:
    """One output column: its name, Arrow type, value for an engine output, value on a row that
    never reached the engine, and (when it differs from the Arrow value) how Ray's numpy
    batches show a value."""

    name: str
    arrow_type: pa.DataType
    value_of: Callable[[GenerationOutput], Any]
    error_value: Any = None
    ray_llm_form: Callable[[Any], Any] | None = None


def logprob_entries(positions: list[dict[int, Logprob] | None] | None) -> list | None:
    """``GenerationOutput.logprobs`` / ``prompt_logprobs`` in column form (see module docstring)."""
    if positions is None:
        return None
    return [None if position is None else
            [{"token_id": token, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in position.items()] for position in positions]


def _by_token_id(positions: list | None) -> list | None:
    """Column-form logprobs as Ray Data LLM's rows hold them: ``{token_id: {...}}`` per position."""
    if positions is None:
        return None
    return [None if entries is None else
            {e["token_id"]: {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["decoded_token"]}
             for e in entries} for entries in positions]


def _unless_failed(value_of: Callable[[GenerationOutput], Any]) -> Callable[[GenerationOutput], Any]:
    """``value_of(out)``, or None for a request that failed."""
    return lambda out: None if out.error is not None else value_of(out)


def _error_text(error: str | None) -> str | None:
    # A message may quote the bad value; an Arrow string column needs valid text.
    return None if error is None else escape_lone_surrogates(error)


OUTPUT_TABLE: tuple[OutputColumn, ...] = (
    OutputColumn("generated_text", pa.string(), _unless_failed(attrgetter("text"))),
    OutputColumn("generated_tokens", pa.list_(pa.int64()), lambda out: list(out.token_ids), error_value=[]),
    OutputColumn("num_input_tokens", pa.int64(), attrgetter("num_input_tokens")),
    OutputColumn("num_generated_tokens", pa.int64(), attrgetter("num_generated_tokens"), error_value=0),
    # prompt tokens whose KV came from the prefix cache
    OutputColumn("num_cached_tokens", pa.int64(), _unless_failed(attrgetter("num_cached_tokens"))),
    OutputColumn("logprobs", LOGPROBS_TYPE, lambda out: logprob_entries(out.logprobs), ray_llm_form=_by_token_id),
    OutputColumn("prompt_logprobs", LOGPROBS_TYPE, lambda out: logprob_entries(out.prompt_logprobs),
                 ray_llm_form=_by_token_id),
    OutputColumn("finish_reason", pa.string(), attrgetter("finish_reason"), error_value="error"),
    OutputColumn("time_taken_llm", pa.float64(), lambda out: out.timings.finished_s),
    OutputColumn(ERROR_COLUMN, pa.string(), lambda out: _error_text(out.error)),  # a bad row's: its error
)
OUTPUT_COLUMNS = tuple(column.name for column in OUTPUT_TABLE)
OUTPUT_SCHEMA = pa.schema([(column.name, column.arrow_type) for column in OUTPUT_TABLE])
RAY_LLM_FORMS = {column.name: column.ray_llm_form for column in OUTPUT_TABLE if column.ray_llm_form is not None}


@dataclass(slots=True)
class RowResult:
    """One row's output values by column name, for every column of ``OUTPUT_TABLE`` (plain
    data: a rebalanced row's result crosses processes)."""

    values: dict[str, Any]

    @classmethod
    def from_output(cls, out: GenerationOutput) -> RowResult:
        return cls({column.name: column.value_of(out) for column in OUTPUT_TABLE})

    @classmethod
    def failed(cls, error: str) -> RowResult:
        values = {column.name: copy.copy(column.error_value) for column in OUTPUT_TABLE}
        values[ERROR_COLUMN] = _error_text(error)
        return cls(values)

    @property
    def error(self) -> str | None:
        return self.values[ERROR_COLUMN]


def output_schema(json_schema: dict | None = None) -> pa.Schema:
    """The columns a stage adds: ``OUTPUT_TABLE``'s, then ``generated_json`` when the job has a
    JSON schema for an object (``json_schema``).

    Example:
        >>> output_schema().names == list(OUTPUT_COLUMNS)
        True
    """
    if json_schema is None:
        return OUTPUT_SCHEMA
    return OUTPUT_SCHEMA.append(pa.field(GENERATED_JSON_COLUMN, json_column_type(json_schema)))


def output_values(results: list[RowResult], schema: pa.Schema = OUTPUT_SCHEMA) -> dict[str, Any]:
    """Each column of ``schema`` (from ``output_schema``) for ``results``, one value per row:
    lists, and ``generated_json`` as an Arrow array of its type."""
    values = {column.name: [r.values[column.name] for r in results] for column in OUTPUT_TABLE}
    if GENERATED_JSON_COLUMN in schema.names:
        field = schema.field(GENERATED_JSON_COLUMN)
        values[field.name] = json_column_values(values["generated_text"], values["finish_reason"], field.type)
    return values
