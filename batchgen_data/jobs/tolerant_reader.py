"""Line-by-line reading of JSONL and CSV text that pyarrow's fast readers reject.

Every input line (a CSV record, which may span lines) gives exactly one row, in file order; blank
lines give none, as in pyarrow. A line that cannot be read (not a JSON object, a CSV row with the
wrong number of fields) becomes a row of nulls whose ``__input_error__`` names the file, the line
and the reason, with the line itself in ``__raw_input__``. A line with invalid bytes keeps its
values, read with U+FFFD in place of each bad byte, and is marked with an error too. The text
comes in decoded with "surrogateescape", so each bad byte is one lone surrogate. A JSON string
escaping half of a UTF-16 pair on its own (``"\\ud83d"``, a cut emoji: valid JSON, but no text)
is treated the same way: the line keeps its values, with U+FFFD in place of each lone surrogate,
and is an error row naming the field.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen_data.jobs.input_table import BAD_BYTES, InputTable, unique_names
from batchgen_data.operators.rows import INPUT_ERROR_COLUMN
from batchgen_data.operators.surrogates import (
    REPLACEMENT,
    find_lone_surrogate,
    replace_lone_surrogates,
)

RAW_INPUT_COLUMN = "__raw_input__"


@dataclass(slots=True)
class Line:
    """One input line: its values (None when unreadable) and why it is an error row, if it is."""

    number: int  # 1-based line in the file where the row starts
    raw: str
    values: Any = None
    error: str | None = None


def read_jsonl(text: str, file_name: str, encoding: str, line_shift: int = 0) -> InputTable:
    """``line_shift``: lines of the file before ``text`` (a part's first line is ``line_shift + 1``)."""
    lines = []
    # JSONL separates rows by "\n" only: str.splitlines would also split at U+2028 in a string.
    for number, raw in enumerate(text.split("\n"), start=1 + line_shift):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        line = _line(number, raw, file_name, encoding)
        try:
            value = json.loads(line.raw)
            if isinstance(value, dict):
                _take_values(line, value, file_name)
            else:
                line.error = f"{file_name} line {number}: expected a JSON object, got {_json_kind(value)}"
        except json.JSONDecodeError as err:
            reason = err.msg.removesuffix(" at").removesuffix(" starting")  # "Unterminated string starting at"
            line.error = f"{file_name} line {number}: invalid JSON at column {err.colno}: {reason}"
        except RecursionError:  # arrays or objects nested some thousand levels deep
            line.values, line.error = None, f"{file_name} line {number}: JSON nested too deeply to read"
        lines.append(line)
    names = list(dict.fromkeys(k for line in lines if line.values is not None for k in line.values))
    columns, json_columns = {}, set()
    for name in names:
        columns[name], is_json = _column([None if line.values is None else line.values.get(name) for line in lines])
        if is_json:
            json_columns.add(name)
    return InputTable(pa.table({**columns, **_error_columns(lines)}), json_columns)


def read_csv(text: str, file_name: str, encoding: str, line_shift: int = 0) -> InputTable:
    """``text`` is the header then a part's records; ``line_shift``: lines of the file between
    the two (a record's line number is its line in ``text`` plus ``line_shift``)."""
    import pyarrow.csv as pacsv

    records = _csv_records(text)
    header = next(records, None)
    if header is None:
        return InputTable(pa.table({}))
    if header[2] is None:
        raise ValueError(f"{file_name}: the CSV header (line {header[0]}) cannot be parsed")
    names = unique_names([_fix_bytes(cell) for cell in header[2]], file_name)
    lines = []
    for number, raw, cells in records:
        number += line_shift
        line = _line(number, raw, file_name, encoding)
        if cells is None or len(cells) != len(names):
            count = "an unparseable row" if cells is None else f"{len(cells)} fields"
            line.error = f"{file_name} line {number}: expected {len(names)} fields (as in the header), got {count}"
        else:
            line.values = [_fix_bytes(cell) for cell in cells]
        lines.append(line)
    # The readable rows go back through pyarrow's CSV reader, so their column types are the ones
    # the fast path would have inferred; unreadable rows become rows of nulls.
    good = [line.values for line in lines if line.values is not None]
    if good:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(good)
        table = pacsv.read_csv(io.BytesIO(buffer.getvalue().encode("utf-8")),
                               read_options=pacsv.ReadOptions(column_names=names),
                               parse_options=pacsv.ParseOptions(newlines_in_values=True))
        if table.num_rows != len(good):  # never seen; a wrong row order would be worse than no file
            raise ValueError(f"{file_name}: {len(good)} readable CSV rows read back as {table.num_rows}")
    else:
        table = pa.table({name: pa.nulls(0, pa.string()) for name in names})
    positions, k = [], 0
    for line in lines:
        positions.append(None if line.values is None else k)
        k += line.values is not None
    table = table.take(pa.array(positions, pa.int64()))
    for name, column in _error_columns(lines).items():
        table = table.append_column(name, column)
    return InputTable(table)


def _csv_records(text: str):
    """(first line number, raw text, cells or None) per CSV record; blank lines are skipped."""
    consumed: list[str] = []

    def source():
        for physical in io.StringIO(text, newline=""):
            consumed.append(physical)
            yield physical

    reader = csv.reader(source())
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error:  # e.g. a field over csv's size limit: this record is unreadable
            cells = None
        raw, number = "".join(consumed).rstrip("\r\n"), reader.line_num - len(consumed) + 1
        consumed.clear()
        if cells != []:
            yield number, raw, cells


def _line(number: int, raw: str, file_name: str, encoding: str) -> Line:
    """The line with U+FFFD for its bad bytes, marked with an error when it has any."""
    if not BAD_BYTES.search(raw):
        return Line(number, raw)
    error = (f"{file_name} line {number}: invalid {encoding} bytes, read as U+FFFD replacement characters "
             f"(pass --encoding if the file is not {encoding})")
    return Line(number, _fix_bytes(raw), error=error)


def _take_values(line: Line, values: dict, file_name: str) -> None:
    """The line's values, repaired and marked as an error row if a string holds a lone surrogate
    (which no Arrow column can hold)."""
    found = find_lone_surrogate(values)
    if found is not None:
        values = replace_lone_surrogates(values)
        line.error = line.error or f"{file_name} line {line.number}: field {found.describe()}, read as U+FFFD"
    line.values = values


def _fix_bytes(text: str) -> str:
    return BAD_BYTES.sub(lambda m: REPLACEMENT * len(m.group()), text)


def _column(values: list) -> tuple[pa.Array, bool]:
    """An Arrow column of ``values``, or their JSON text when Arrow has no one type that holds
    them all as they are. ``pa.array`` may find a type by changing values (``[0.0, false]`` as
    doubles ``[0, 0]``): the column is kept only if every value reads back the same."""
    try:
        array = pa.array(values)
        if all(_kept(v, b) for v, b in zip(values, array.to_pylist())):
            return array, False
    except (pa.ArrowException, OverflowError, TypeError):
        pass
    texts = [None if v is None else json.dumps(v, ensure_ascii=False) for v in values]
    return pa.array(texts, pa.string()), True


def _kept(value: Any, back: Any) -> bool:
    """Whether ``back`` (a value read back from Arrow) is ``value``: the same booleans, numbers
    of the same value (an integer may come back as an equal float), strings, lists, and objects
    (a key another row has comes back null)."""
    if value is None or isinstance(value, (bool, str)):
        return back is value or (type(back) is type(value) and back == value)
    if isinstance(value, (int, float)):
        return isinstance(back, (int, float)) and not isinstance(back, bool) and back == value
    if isinstance(value, list):
        return isinstance(back, list) and len(back) == len(value) and all(map(_kept, value, back))
    if isinstance(value, dict):
        return (isinstance(back, dict) and all(_kept(v, back.get(k)) for k, v in value.items())
                and all(back[k] is None for k in back.keys() - value.keys()))
    return back == value


def _error_columns(lines: list[Line]) -> dict[str, pa.Array]:
    return {
        INPUT_ERROR_COLUMN: pa.array([line.error for line in lines], pa.string()),
        RAW_INPUT_COLUMN: pa.array([line.raw if line.error is not None else None for line in lines], pa.string()),
    }


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)
