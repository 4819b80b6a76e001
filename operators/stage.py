"""The row pipeline both stages run around their engine call: ``prepare_batch``, then
``finish_batch``.

``prepare_batch`` reads the batch and validates each row; the stage runs the valid rows
(``prepared.prompts`` with ``prepared.params``) through its engine, sync, async or through the
rebalancer, and hands their results, in the same order, to ``finish_batch``. That puts every row
back in input order (a bad row's result is its error), raises on a bad row if the stage asked
for that, and adds the output columns in the batch's own format. Only the engine call differs
between stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from batchgen_data.operators.batch_format import to_columns, with_output_columns
from batchgen_data.operators.columns import RowResult, fill_row_columns, output_schema, output_values
from batchgen_data.operators.rows import PreparedRow, StageConfig, check_errors, prepare_rows

from batchgen_data.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class PreparedBatch:
    """One batch between its two halves: every row, and the valid ones for the engine."""

    batch: Any  # the batch as handed over, for ``with_output_columns``
    rows: list[PreparedRow]
    valid_rows: list[PreparedRow]  # the rows for the engine, in input order
    input_prompts: list[Any]  # each row's ``prompt`` column (None without one): an error row keeps it

    @property
    def prompts(self) -> list[Any]:
        return [row.prompt for row in self.valid_rows]

    @property
    def params(self) -> list[SamplingParams]:
        return [row.params for row in self.valid_rows]


def prepare_batch(batch: Any, config: StageConfig) -> PreparedBatch:
    """Read ``batch`` (pyarrow, pandas or a dict of columns) and validate each of its rows."""
    columns, num_rows = to_columns(batch)
    rows = prepare_rows(columns, num_rows, config)
    input_prompts = columns.get("prompt") or [None] * num_rows
    return PreparedBatch(batch, rows, [row for row in rows if row.error is None], list(input_prompts))


def finish_batch(prepared: PreparedBatch, results: list[RowResult], config: StageConfig,
                 decode: Callable[[list[int]], str] | None = None) -> Any:
    """``prepared.batch`` with the output columns: ``results`` are the valid rows' (in their
    order), error rows get theirs from their error; ``decode`` (token ids -> text, special tokens
    kept) renders a chat row's ``prompt`` column from its token ids."""
    by_index = {row.index: result for row, result in zip(prepared.valid_rows, results, strict=True)}
    all_results = [
        RowResult.failed(row.error) if row.error is not None else by_index[row.index]
        for row in prepared.rows
    ]
    check_errors(prepared.rows, all_results, config)
    fill_row_columns(all_results, [row.params for row in prepared.rows], [row.prompt for row in prepared.rows],
                     prepared.input_prompts, decode)
    schema = stage_output_schema(config)
    return with_output_columns(prepared.batch, output_values(all_results, schema), schema)


def stage_output_schema(config: StageConfig) -> pa.Schema:
    """The columns the stage adds to every batch (``columns.output_schema``): ``generated_json``
    among them when the stage's default ``structured_outputs`` is a JSON schema for an object."""
    constraint = config.default_params().structured_outputs
    return output_schema(None if constraint is None else constraint.object_schema)
