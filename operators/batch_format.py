"""Batches in the formats Ray Data and datasets hand over: pyarrow, pandas, numpy dicts, dicts of lists.

``to_columns`` reads any of them as a dict of Python lists; ``with_output_columns`` returns the
same format with the output columns added under their types (``columns.py``), after the input
columns and replacing any input column of the same name (``prompt``, as Ray Data LLM's chat
template stage does), so every batch has one schema, and without the reader's ``__input_error__`` column (its message is now in
``__inference_error__``). A ``datasets`` batch (``Dataset.map``'s ``LazyBatch``) is read and
returned as the Arrow table under it: a dict of lists would leave ``datasets`` to infer each
column's type from its first batch's values (null when they are all null, and a later batch's
values then fail to write).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from batchgen_data.operators.columns import LOGPROBS_TYPE, OUTPUT_SCHEMA
from batchgen_data.operators.rows import INPUT_ERROR_COLUMN

__all__ = ["LOGPROBS_TYPE", "OUTPUT_SCHEMA", "to_columns", "with_output_columns"]


def to_columns(batch: Any) -> tuple[dict[str, list], int]:
    """Columns as Python-indexable sequences, and the row count."""
    batch = _arrow_under(batch)
    if isinstance(batch, pa.Table):
        return {name: batch.column(name).to_pylist() for name in batch.column_names}, batch.num_rows
    if _is_pandas(batch):
        return {name: batch[name].tolist() for name in batch.columns}, len(batch)
    if isinstance(batch, Mapping):  # dicts, and datasets' IterableDataset batches
        batch = {k: batch[k] for k in batch.keys()}
        lengths = {len(v) for v in batch.values()}
        if len(lengths) > 1:
            raise ValueError(f"batch columns have different lengths: {sorted(lengths)}")
        return {k: (v.tolist() if isinstance(v, np.ndarray) else list(v)) for k, v in batch.items()}, (
            lengths.pop() if lengths else 0
        )
    raise TypeError(f"unsupported batch type {type(batch).__name__}: use pyarrow, pandas or a dict of columns")


def with_output_columns(batch: Any, added: dict[str, Any], schema: pa.Schema = OUTPUT_SCHEMA) -> Any:
    """``batch`` plus the columns of ``schema`` (``columns.output_schema``), whose values
    ``added`` holds (lists, or Arrow arrays of the column's type), in the batch's own format."""
    names = schema.names
    batch = _arrow_under(batch)
    if isinstance(batch, pa.Table):
        table = batch.drop_columns([c for c in (*names, INPUT_ERROR_COLUMN) if c in batch.column_names])
        for field in schema:
            table = table.append_column(field, _as_array(added[field.name], field.type))
        return table
    if _is_pandas(batch):
        import pandas as pd

        frame = batch.drop(columns=[c for c in (*names, INPUT_ERROR_COLUMN) if c in batch.columns])
        arrow = pa.table({f.name: _as_array(added[f.name], f.type) for f in schema})
        typed = arrow.to_pandas(types_mapper=pd.ArrowDtype)
        for name in names:
            frame[name] = typed[name].values
        return frame
    added = {k: v.to_pylist() if isinstance(v, pa.Array) else v for k, v in added.items()}
    if _is_ray_numpy(batch):  # Ray Data's numpy batches
        out = {k: v for k, v in batch.items() if k != INPUT_ERROR_COLUMN and k not in names}
        for field in schema:
            out[field.name] = _numpy_column(added[field.name], field)
        return out
    if isinstance(batch, Mapping):  # dicts, and datasets' IterableDataset batches
        kept = {k: batch[k] for k in batch.keys() if k != INPUT_ERROR_COLUMN and k not in names}
        return {**kept, **{name: list(added[name]) for name in names}}
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def _numpy_column(values: list, field: pa.Field) -> np.ndarray:
    if pa.types.is_integer(field.type) and None not in values:
        return np.asarray(values, dtype=np.int64)
    if pa.types.is_floating(field.type) and None not in values:
        return np.asarray(values, dtype=np.float64)
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def _is_ray_numpy(batch: Any) -> bool:
    return isinstance(batch, Mapping) and bool(batch) and all(isinstance(v, np.ndarray) for v in batch.values())


def _arrow_under(batch: Any) -> Any:
    """A ``datasets`` ``LazyBatch``'s Arrow table (see module docstring); any other batch as is."""
    if type(batch).__name__ == "LazyBatch" and isinstance(getattr(batch, "pa_table", None), pa.Table):
        return batch.pa_table
    return batch


def _as_array(values: Any, type_: pa.DataType) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, type=type_)


def _is_pandas(batch: Any) -> bool:
    return type(batch).__name__ == "DataFrame" and hasattr(batch, "columns")
