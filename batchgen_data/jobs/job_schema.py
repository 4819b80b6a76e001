"""One schema for every part of a job: the union of the parts' columns, one type per column.

Parts of one job may differ: a column only some files (or some parts of a file) have, ``id`` as
numbers in a Parquet file and as strings in a JSONL file, ``tags`` empty in one part and holding
strings in the next. Every part (and every Ray block, which Ray Data concatenates into batches)
gets all the job's columns, null where its part lacks one. ``SchemaBuilder`` learns the schema one
part at a time, keeping only each column's types and the range of its integers, never the rows.

A column whose types differ takes their common type where Arrow has one and every value keeps
its exact value in it (int64 and double -> double, unless an integer beyond 2**53 would round;
list<null> and list<string> -> list<string>); otherwise it is stored as JSON text in every part,
like a column of mixed types inside one part, and the stage decodes it per row before validation
(``StageConfig.json_columns``). So is a column nested deeper than Parquet can write.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from batchgen_data.jobs.input_table import InputTable, leaf_types
from batchgen_data.jobs.tolerant_reader import RAW_INPUT_COLUMN
from batchgen_data.operators.rows import INPUT_ERROR_COLUMN

EXACT_FLOAT_INTEGERS = 2**53  # every integer up to this magnitude is exact in a double
INT64_MAX = 2**63 - 1


@dataclass(slots=True)
class JobSchema:
    """The job's columns in order, each one's Arrow type, and those stored as JSON text."""

    names: list[str]
    types: dict[str, pa.DataType]
    json_columns: list[str]

    def column_types(self) -> dict[str, str]:
        """Each column's type as text (``"json"`` for JSON-text columns): what the manifest
        records, so a rerun that would write parts of other columns is caught."""
        json_columns = set(self.json_columns)
        return {name: "json" if name in json_columns else str(self.types[name]) for name in self.names}

    def conform(self, source: InputTable) -> pa.Table:
        """``source``'s rows with every column of the job, in order, of the job's types."""
        table = source.table
        index = {name: i for i, name in enumerate(table.column_names)}
        json_columns, arrays = set(self.json_columns), []
        for name in self.names:
            i = index.get(name)
            target = self.types.get(name, pa.string())
            if i is None:
                arrays.append(pa.nulls(table.num_rows, target))
            elif name not in json_columns:
                column = table.column(i)
                arrays.append(column if column.type == target else column.cast(target))
            elif name in source.json_columns:
                arrays.append(table.column(i))
            else:
                arrays.append(_json_text(table.column(i)))
        return pa.Table.from_arrays(arrays, self.names)


@dataclass(slots=True)
class _Column:
    types: dict[pa.DataType, None] = field(default_factory=dict)  # the distinct types, in order
    is_json: bool = False
    int_low: int | None = None  # the smallest and largest integer at any depth, over every part
    int_high: int | None = None
    ints_unknown: bool = False  # a part whose integers were not looked at (no Parquet statistics)

    def add_ints(self, low: int | None, high: int | None) -> None:
        if low is not None:
            self.int_low = low if self.int_low is None else min(self.int_low, low)
            self.int_high = high if self.int_high is None else max(self.int_high, high)


class SchemaBuilder:
    """The job's schema, learnt one part (or one file's schema) at a time."""

    def __init__(self):
        self.columns: dict[str, _Column] = {}

    def add(self, source: InputTable) -> None:
        """One part's columns: their types and, for integer columns, their range."""
        for i, f in enumerate(source.table.schema):
            column = self.columns.setdefault(f.name, _Column())
            if f.name in source.json_columns:
                column.is_json = True
                continue
            column.types[f.type] = None
            if _has_integers(f.type):
                column.add_ints(*integer_range(source.table.column(i)))

    def add_schema(self, schema: pa.Schema, int_ranges: dict[str, tuple[int, int] | None]) -> None:
        """A whole file's columns without its rows (a Parquet file): ``int_ranges`` gives each
        integer column's range from the file's statistics, None where they are missing."""
        for f in schema:
            column = self.columns.setdefault(f.name, _Column())
            column.types[f.type] = None
            if _has_integers(f.type):
                found = int_ranges.get(f.name)
                if found is None:
                    column.ints_unknown = True
                else:
                    column.add_ints(*found)

    def merge(self, other: SchemaBuilder) -> None:
        """Add what ``other`` learnt (one file's parts, added once the whole file scanned)."""
        for name, theirs in other.columns.items():
            ours = self.columns.setdefault(name, _Column())
            ours.types.update(theirs.types)
            ours.is_json |= theirs.is_json
            ours.ints_unknown |= theirs.ints_unknown
            ours.add_ints(theirs.int_low, theirs.int_high)

    def finish(self) -> JobSchema:
        names = list(self.columns)
        # The reader's columns go last, as in a file read line by line, whichever part came first.
        names.sort(key=lambda name: name in (INPUT_ERROR_COLUMN, RAW_INPUT_COLUMN))
        types, json_columns = {}, []
        for name in names:
            common = None if self.columns[name].is_json else _common_type(self.columns[name])
            if common is None:
                json_columns.append(name)
            else:
                types[name] = common
        return JobSchema(names, types, sorted(json_columns))


def integer_range(column: pa.ChunkedArray | pa.Array) -> tuple[int | None, int | None]:
    """The smallest and largest integer in ``column`` at any depth (None, None when it has none)."""
    low = high = None
    for array in _integer_leaves(column):
        found = pc.min_max(array).as_py()
        if found["min"] is not None:
            low = found["min"] if low is None else min(low, found["min"])
            high = found["max"] if high is None else max(high, found["max"])
    return low, high


def _integer_leaves(array):
    if isinstance(array, pa.ChunkedArray):
        for chunk in array.chunks:
            yield from _integer_leaves(chunk)
        return
    kind = array.type
    if pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            yield from _integer_leaves(array.field(i))
    elif pa.types.is_map(kind):
        yield from _integer_leaves(array.keys)
        yield from _integer_leaves(array.items)
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        yield from _integer_leaves(array.flatten())
    elif pa.types.is_integer(kind):
        yield array


def _has_integers(arrow_type: pa.DataType) -> bool:
    return any(pa.types.is_integer(t) for t in leaf_types(arrow_type))


def _common_type(column: _Column) -> pa.DataType | None:
    """The type every part's values take exactly, or None (the column is stored as JSON text)."""
    distinct = [t for t in column.types if not pa.types.is_null(t)] or [pa.null()]
    if len(distinct) == 1:
        common = distinct[0]
    else:
        try:
            merged = pa.unify_schemas([pa.schema([("c", t)]) for t in distinct], promote_options="permissive")
            common = merged.field("c").type
            for t in distinct:
                pa.array([], t).cast(common)  # a struct or list may unify on paper yet not cast
        except (pa.ArrowException, NotImplementedError):
            return None
        if not _integers_fit(column, distinct, common):
            return None
    return common if writable_in_parquet(common) else None


def _integers_fit(column: _Column, distinct: list[pa.DataType], common: pa.DataType) -> bool:
    """Whether the column's integers keep their values in ``common`` (they change type only
    when the parts' types differ)."""
    if not any(_has_integers(t) for t in distinct):
        return True
    if column.ints_unknown:
        return False
    low, high = column.int_low, column.int_high
    if low is None:
        return True
    leaves = list(leaf_types(common))
    if any(pa.types.is_floating(t) for t in leaves) and max(-low, high) > EXACT_FLOAT_INTEGERS:
        return False
    if any(pa.types.is_signed_integer(t) for t in leaves) and high > INT64_MAX:
        return False
    return True


@functools.lru_cache(maxsize=256)
def writable_in_parquet(arrow_type: pa.DataType) -> bool:
    """Whether a Parquet file with a column of this type can be written and read back (Parquet
    limits how deeply a schema nests: about 50 levels of lists)."""
    if not pa.types.is_nested(arrow_type):
        return True
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    try:
        pq.write_table(pa.table({"c": pa.array([], arrow_type)}), buffer)
        pq.read_schema(io.BytesIO(buffer.getvalue()))
    except (pa.ArrowException, OSError):
        return False
    return True


def _json_text(column: pa.ChunkedArray) -> pa.Array:
    # default=str: timestamps, decimals and bytes have no JSON form; their text is kept.
    values = column.to_pylist()
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in values], pa.string())
