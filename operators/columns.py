"""The output columns: one table, from which every stage, batch format and the CLI take theirs.

Every output row has every column of ``OUTPUT_TABLE``, in its order (``__inference_error__``
null on success), so every batch, and every Parquet part of a job, has one schema. Each entry
gives the column's Arrow type, its value for an engine output, and its value on a row that never
reached the engine (a bad row). With a job-wide JSON schema for an object, the typed
``generated_json`` column follows them (``output_schema``; its type and values: ``json_column.py``).

The columns and their values on success and on failure are those Ray Data LLM 2.60's vLLM stage
writes (``generated_text`` "" and ``request_id`` / ``time_taken_llm`` -1 on an error row, the
rendered ``prompt``, ``prompt_token_ids``, ``params``, ``batch_uuid``, ``metrics``,
``embeddings``), plus ``num_cached_tokens`` and ``finish_reason``. ``prompt``, ``params`` and
``batch_uuid`` depend on the row and its batch, not the engine output: the stage fills them
(``fill_row_columns``).

Logprobs go from the engine's output (one ``{token_id: Logprob}`` per position) to their column
form once, here: per position, a list of ``{token_id, logprob, rank, decoded_token}`` entries,
the token that was there first. That is an Arrow type in every batch format (Ray Data LLM's
``{token_id: {...}}`` dicts have int keys, which Arrow has no struct for: Ray stores them as
pickled Python objects).
"""

from __future__ import annotations

import copy
import uuid
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
from batchgen_data.errors import one_line

ERROR_COLUMN = "__inference_error__"
LOGPROB_ENTRY = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
                           ("decoded_token", pa.string())])
LOGPROBS_TYPE = pa.list_(pa.list_(LOGPROB_ENTRY))


@dataclass(slots=True, frozen=True)
class OutputColumn:
    """One output column: its name, Arrow type, value for an engine output, and value on a row
    that never reached the engine."""

    name: str
    arrow_type: pa.DataType
    value_of: Callable[[GenerationOutput], Any]
    error_value: Any = None


def logprob_entries(positions: list[dict[int, Logprob] | None] | None) -> list | None:
    """``GenerationOutput.logprobs`` / ``prompt_logprobs`` in column form (see module docstring)."""
    if positions is None:
        return None
    return [None if position is None else
            [{"token_id": token, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in position.items()] for position in positions]


def _unless_failed(value_of: Callable[[GenerationOutput], Any]) -> Callable[[GenerationOutput], Any]:
    """``value_of(out)``, or None for a request that failed."""
    return lambda out: None if out.error is not None else value_of(out)


def _error_text(error: str | None) -> str | None:
    # Every row's error is one line (no traceback or library backtrace); a message may quote the
    # bad value, and an Arrow string column needs valid text.
    return None if error is None else escape_lone_surrogates(one_line(error))


def _or_error(value_of: Callable[[GenerationOutput], Any], error_value: Any) -> Callable[[GenerationOutput], Any]:
    """``value_of(out)``, or ``error_value`` (Ray's value on an error row) for a request that failed."""
    return lambda out: copy.copy(error_value) if out.error is not None else value_of(out)


def _metrics(out: GenerationOutput) -> dict:
    """vLLM's request stats under their names (``RequestStateStats``), those this engine keeps."""
    return {"num_generation_tokens": out.num_generated_tokens, "first_token_latency": out.timings.first_token_s}


METRICS_TYPE = pa.struct([("num_generation_tokens", pa.int64()), ("first_token_latency", pa.float64())])
# Filled per row by the stage (``fill_row_columns``), not from the engine output.
ROW_COLUMNS = ("prompt", "params", "batch_uuid")
OUTPUT_TABLE: tuple[OutputColumn, ...] = (
    OutputColumn("generated_text", pa.string(), _or_error(attrgetter("text"), ""), error_value=""),
    OutputColumn("generated_tokens", pa.list_(pa.int64()), lambda out: list(out.token_ids), error_value=[]),
    OutputColumn("num_input_tokens", pa.int64(), _or_error(attrgetter("num_input_tokens"), 0), error_value=0),
    OutputColumn("num_generated_tokens", pa.int64(), attrgetter("num_generated_tokens"), error_value=0),
    OutputColumn("prompt", pa.string(), lambda out: None),  # the text the engine ran (fill_row_columns)
    OutputColumn("prompt_token_ids", pa.list_(pa.int64()), _or_error(lambda out: list(out.prompt_token_ids), None)),
    # prompt tokens whose KV came from the prefix cache
    OutputColumn("num_cached_tokens", pa.int64(), _unless_failed(attrgetter("num_cached_tokens"))),
    OutputColumn("embeddings", pa.list_(pa.float32()), _or_error(attrgetter("embeddings"), None)),
    OutputColumn("logprobs", LOGPROBS_TYPE, lambda out: logprob_entries(out.logprobs)),
    OutputColumn("prompt_logprobs", LOGPROBS_TYPE, lambda out: logprob_entries(out.prompt_logprobs)),
    OutputColumn("finish_reason", pa.string(), attrgetter("finish_reason"), error_value="error"),
    OutputColumn("metrics", METRICS_TYPE, _or_error(_metrics, None)),
    OutputColumn("request_id", pa.int64(), _or_error(attrgetter("request_id"), -1), error_value=-1),
    OutputColumn("batch_uuid", pa.string(), lambda out: None),  # the batch's (fill_row_columns)
    OutputColumn("params", pa.string(), lambda out: None),  # the row's SamplingParams (fill_row_columns)
    OutputColumn("time_taken_llm", pa.float64(), _or_error(lambda out: out.timings.finished_s, -1.0),
                 error_value=-1.0),
    OutputColumn(ERROR_COLUMN, pa.string(), lambda out: _error_text(out.error)),  # a bad row's: its error
)
OUTPUT_COLUMNS = tuple(column.name for column in OUTPUT_TABLE)
OUTPUT_SCHEMA = pa.schema([(column.name, column.arrow_type) for column in OUTPUT_TABLE])


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


def fill_row_columns(results: list[RowResult], params: list[Any], prompts: list[Any], input_prompts: list[Any],
                     decode: Callable[[list[int]], str] | None = None) -> None:
    """Set each row's ``ROW_COLUMNS``, as Ray Data LLM's stages write them: ``prompt`` is the text
    the engine ran (a chat row's rendered template, decoded from its token ids with ``decode``),
    else the row's ``prompt`` column (an error row keeps its own); ``params`` the row's sampling
    params as text ("" on an error row); ``batch_uuid`` one hex id for the batch.

    Args:
        results: every row's result, in input order.
        params, prompts: each row's ``SamplingParams`` and prompt (None on an error row).
        input_prompts: each row's ``prompt`` column value (None where it has none).
        decode: token ids -> text, special tokens kept (the engine's tokenizer).
    """
    batch_uuid = uuid.uuid4().hex
    for result, row_params, prompt, given in zip(results, params, prompts, input_prompts, strict=True):
        values = result.values
        text = given if isinstance(given, str) else None
        if result.error is None:
            if isinstance(prompt, str):
                text = prompt
            elif decode is not None and values["prompt_token_ids"] and not _is_token_ids(prompt):
                text = decode(values["prompt_token_ids"])
        values["prompt"] = escape_lone_surrogates(text) if text is not None else None
        values["params"] = "" if result.error is not None or row_params is None else repr(row_params)
        values["batch_uuid"] = batch_uuid


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)
