"""Batches in the formats Ray Data and datasets hand over: pyarrow, pandas, numpy dicts, dicts of lists.

``to_columns`` reads any of them as a dict of Python lists; ``with_output_columns`` returns the
same format with the output columns added under fixed types, so every batch has one schema, and
without the reader's ``__input_error__`` column (its message is now in ``__inference_error__``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from batchgen_data.operators.rows import INPUT_ERROR_COLUMN

# Logprobs: Ray Data LLM's rows hold, per position, {token_id: {logprob, rank, decoded_token}};
# Arrow (and datasets, which has no map type) holds each position as a list of entries with
# their token_id, the generated or prompt token first.
LOGPROB_ENTRY = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
                           ("decoded_token", pa.string())])
LOGPROBS_TYPE = pa.list_(pa.list_(LOGPROB_ENTRY))
LOGPROB_COLUMNS = ("logprobs", "prompt_logprobs")

OUTPUT_SCHEMA = pa.schema(
    [
        ("generated_text", pa.string()),
        ("generated_tokens", pa.list_(pa.int64())),
        ("num_input_tokens", pa.int64()),
        ("num_generated_tokens", pa.int64()),
        ("num_cached_tokens", pa.int64()),
        ("logprobs", LOGPROBS_TYPE),
        ("prompt_logprobs", LOGPROBS_TYPE),
        ("finish_reason", pa.string()),
        ("time_taken_llm", pa.float64()),
        ("__inference_error__", pa.string()),
    ]
)


def to_columns(batch: Any) -> tuple[dict[str, list], int]:
    """Columns as Python-indexable sequences, and the row count."""
    if isinstance(batch, pa.Table):
        return {name: batch.column(name).to_pylist() for name in batch.column_names}, batch.num_rows
    if _is_pandas(batch):
        return {name: batch[name].tolist() for name in batch.columns}, len(batch)
    if isinstance(batch, Mapping):  # dicts, and datasets' LazyBatch
        batch = {k: batch[k] for k in batch.keys()}
        lengths = {len(v) for v in batch.values()}
        if len(lengths) > 1:
            raise ValueError(f"batch columns have different lengths: {sorted(lengths)}")
        return {k: (v.tolist() if isinstance(v, np.ndarray) else list(v)) for k, v in batch.items()}, (
            lengths.pop() if lengths else 0
        )
    raise TypeError(f"unsupported batch type {type(batch).__name__}: use pyarrow, pandas or a dict of columns")


def with_output_columns(batch: Any, added: dict[str, Any], extra: list[pa.Field] = ()) -> Any:
    """``batch`` plus the output columns (``OUTPUT_SCHEMA``, then the ``extra`` fields, such as
    the typed ``generated_json``, whose values may be Arrow arrays), in the batch's own format."""
    schema = [*OUTPUT_SCHEMA, *extra]
    names = [field.name for field in schema]
    ray_numpy = isinstance(batch, Mapping) and batch and all(isinstance(v, np.ndarray) for v in batch.values())
    if not ray_numpy:  # Arrow-shaped values: logprob entries as lists (see LOGPROBS_TYPE)
        added = {**added, **{name: [_entry_lists(row) for row in added[name]] for name in LOGPROB_COLUMNS}}
    if isinstance(batch, pa.Table):
        table = batch.drop_columns([c for c in (*names, INPUT_ERROR_COLUMN) if c in batch.column_names])
        for field in schema:
            table = table.append_column(field, _as_array(added[field.name], field.type))
        return table
    if _is_pandas(batch):
        import pandas as pd

        frame = batch.drop(columns=[INPUT_ERROR_COLUMN], errors="ignore")
        arrow = pa.table({f.name: _as_array(added[f.name], f.type) for f in schema})
        typed = arrow.to_pandas(types_mapper=pd.ArrowDtype)
        for name in names:
            frame[name] = typed[name].values
        return frame
    added = {k: v.to_pylist() if isinstance(v, pa.Array) else v for k, v in added.items()}
    if ray_numpy:  # Ray Data's numpy batches: Ray Data LLM's dicts, kept as Python objects
        out = {k: v for k, v in batch.items() if k != INPUT_ERROR_COLUMN}
        for field in schema:
            values = added[field.name]
            if pa.types.is_integer(field.type) and None not in values:
                out[field.name] = np.asarray(values, dtype=np.int64)
            elif pa.types.is_floating(field.type) and None not in values:
                out[field.name] = np.asarray(values, dtype=np.float64)
            else:
                column = np.empty(len(values), dtype=object)
                column[:] = values
                out[field.name] = column
        return out
    if isinstance(batch, Mapping):  # dicts, and datasets' LazyBatch
        kept = {k: batch[k] for k in batch.keys() if k != INPUT_ERROR_COLUMN}
        return {**kept, **{name: list(added[name]) for name in names}}
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def _entry_lists(positions: list | None) -> list | None:
    """One row's logprobs, ``{token_id: {...}}`` per position, as lists of entries."""
    if positions is None:
        return None
    return [None if p is None else [{"token_id": t, **v} for t, v in p.items()] for p in positions]


def _as_array(values: Any, type_: pa.DataType) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, type=type_)


def _is_pandas(batch: Any) -> bool:
    return type(batch).__name__ == "DataFrame" and hasattr(batch, "columns")
