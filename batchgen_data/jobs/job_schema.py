"""One schema for every part of a job: the union of the input files' columns, one type per column.

Files of one folder may differ: a column only some files have, ``id`` as numbers in a Parquet
file and as strings in a JSONL file. Every part (and every Ray block, which Ray Data concatenates
into batches) gets all the job's columns, null where its file lacks one. A column whose types
differ between files takes their common type when Arrow has one (int64 and double -> double);
otherwise it is stored as JSON text in every file, like a column of mixed types inside one file,
and the stage decodes it per row before validation (``StageConfig.json_columns``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from batchgen_data.jobs.input_table import InputTable
from batchgen_data.jobs.tolerant_reader import RAW_INPUT_COLUMN
from batchgen_data.operators.rows import INPUT_ERROR_COLUMN


@dataclass(slots=True)
class JobTables:
    tables: list[pa.Table]
    json_columns: list[str]

    def column_types(self) -> dict[str, str]:
        """Each column's type as text (``"json"`` for JSON-text columns): what the manifest
        records, so a rerun that would write parts of other columns is caught."""
        if not self.tables:
            return {}
        schema = self.tables[0].schema
        return {f.name: "json" if f.name in self.json_columns else str(f.type) for f in schema}


def unify(inputs: list[InputTable]) -> JobTables:
    names = list(dict.fromkeys(name for i in inputs for name in i.table.column_names))
    # The reader's columns go last, as in a file read line by line, whichever file came first.
    names.sort(key=lambda name: name in (INPUT_ERROR_COLUMN, RAW_INPUT_COLUMN))
    json_columns = set().union(*(i.json_columns for i in inputs))
    types: dict[str, pa.DataType] = {}
    for name in names:
        if name not in json_columns:
            common = _common_type([i.table.column(name) for i in inputs if name in i.table.column_names])
            if common is None:
                json_columns.add(name)
            else:
                types[name] = common
    tables = [_conform(i, names, types, json_columns) for i in inputs]
    return JobTables(tables, sorted(json_columns))


def _common_type(columns: list[pa.ChunkedArray]) -> pa.DataType | None:
    """The type every column casts to, or None when they have none."""
    distinct = list(dict.fromkeys(c.type for c in columns))
    if len(distinct) == 1:
        return distinct[0]
    try:
        common = pa.unify_schemas([pa.schema([("c", t)]) for t in distinct], promote_options="permissive")
        common_type = common.field("c").type
        for column in columns:
            column.cast(common_type)  # a struct or list may unify on paper yet not cast
    except (pa.ArrowException, NotImplementedError):
        return None
    return common_type


def _conform(source: InputTable, names: list[str], types: dict[str, pa.DataType], json_columns: set[str]) -> pa.Table:
    table, arrays = source.table, []
    for name in names:
        if name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, types.get(name, pa.string())))
        elif name not in json_columns:
            arrays.append(table.column(name).cast(types[name]))
        elif name in source.json_columns:
            arrays.append(table.column(name))
        else:
            arrays.append(_json_text(table.column(name)))
    return pa.Table.from_arrays(arrays, names)


def _json_text(column: pa.ChunkedArray) -> pa.Array:
    # default=str: timestamps, decimals and bytes have no JSON form; their text is kept.
    values = column.to_pylist()
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in values], pa.string())
