"""One part of an input file as an Arrow table: pyarrow's fast readers first, a line-by-line reader after.

Parquet parts are read by pyarrow from the row groups that hold them. JSONL and CSV parts (byte
ranges found by ``text_chunks``) are decoded first (UTF-8 unless the job names another encoding;
a UTF-8 BOM is dropped). A part that decodes cleanly goes to pyarrow's fast reader; one with
invalid bytes, or one pyarrow rejects (a malformed line, a column of mixed types, a CSV row with
the wrong number of fields), is read line by line (``tolerant_reader``), where each bad line
becomes an error row and every other line reads as it would have.

Values come back as they went in. pyarrow's readers turn a column of integers and floats, or an
integer beyond int64, into doubles, which rounds integers beyond 2**53 (ids, the values ETL jobs
join on). A part whose fast read has a floating column and whose text holds such an integer, or
that pyarrow's JSON reader reads into an invalid table (a list whose first item is null), is
read by the exact readers instead: JSON by Python's ``json`` (a column that cannot hold its values
exactly is stored as JSON text), a CSV column as JSON text of its cells' values.
"""

from __future__ import annotations

import codecs
import io
import logging
import re
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import ConfigError
from batchgen_data.jobs import tolerant_reader
from batchgen_data.jobs.input_table import BAD_BYTES, InputTable, has_floating, unique_names

logger = logging.getLogger(__name__)

INPUT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
UTF8_BOM = codecs.BOM_UTF8
# An integer literal of 16 or more digits: possibly beyond 2**53 (9007199254740992), where a
# double no longer holds every integer.
_LONG_INTEGER = re.compile(rb"(?<![\w.])-?\d{16,}(?![\w.])")
_LONG_INTEGER_CELL = r"^\s*[+-]?\d{16,}\s*$"
# A JSONL line that is not an object. pyarrow's JSON reader crashes the process on a first line
# ``null`` and reads a later ``null`` as a row of nulls: such a part goes to the line-by-line
# reader, which makes that line an error row.
_NOT_AN_OBJECT = re.compile(rb"(?m)^[ \t\r\f\v]*[^{\s]")


class RowCountError(ValueError):
    """A part read back with another number of rows than the scan counted."""


def input_kind(path: Path) -> str | None:
    """``"parquet"``, ``"jsonl"`` or ``"csv"`` by the file's extension; None when unsupported."""
    return INPUT_SUFFIXES.get(path.suffix.lower())


def resolve_encoding(encoding: str | None) -> str:
    """The codec's canonical name (``None`` is UTF-8); an unknown one is a config error."""
    try:
        return codecs.lookup(encoding or "utf-8").name
    except LookupError:
        raise ConfigError(f"unknown encoding {encoding!r}: use a Python codec name such as utf-8 or latin-1") from None


def read_input(path: Path, encoding: str = "utf-8") -> InputTable:
    """Read one whole input file (small files, tests). Raises ``OSError`` or
    ``pyarrow.ArrowException`` when the file cannot be read at all; bad lines become error rows."""
    kind = input_kind(path)
    if kind is None:
        raise ValueError(f"{path.name}: unsupported file type {path.suffix!r}")
    if kind == "parquet":
        return read_parquet_rows(path, 0, None)
    return read_text(kind, path.read_bytes(), path.name, encoding)


def read_parquet_rows(path: Path, start: int, num_rows: int | None) -> InputTable:
    """Rows ``start`` to ``start + num_rows`` of a Parquet file (all with None), reading only the
    row groups that hold them. A zero-byte file (created, never written) has zero rows."""
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        return InputTable(pa.table({}))
    parquet = pq.ParquetFile(path)
    if num_rows is None:
        return InputTable(parquet.read())
    groups, first, row = [], None, 0
    for i in range(parquet.metadata.num_row_groups):
        n = parquet.metadata.row_group(i).num_rows
        if row + n > start and row < start + num_rows:
            groups.append(i)
            first = row if first is None else first
        row += n
    table = parquet.read_row_groups(groups) if groups else parquet.schema_arrow.empty_table()
    return InputTable(table.slice(start - (first or 0), num_rows))


def read_text(kind: str, data: bytes, name: str, encoding: str = "utf-8", first_line: int = 1,
              header: bytes = b"", header_lines: int = 0, num_rows: int | None = None) -> InputTable:
    """A JSONL or CSV part: ``data`` holds its lines, the first being line ``first_line`` of the
    file; a CSV part comes with the file's ``header`` record (``header_lines`` lines).
    ``num_rows``: the rows the scan counted; a part that reads with other counts raises
    ``RowCountError`` (its rows would be misnumbered)."""
    data = header + data if kind == "csv" else data
    text = _decode(data, encoding, name)
    if not text.strip():
        return InputTable(pa.table({}))
    line_shift = first_line - 1 - header_lines if kind == "csv" else first_line - 1
    read = None
    if not BAD_BYTES.search(text):
        clean = data.removeprefix(UTF8_BOM) if encoding == "utf-8" else text.encode("utf-8")
        try:
            read = _fast_read(kind, clean, name)
        except pa.ArrowException as err:
            logger.info("%s: pyarrow's reader failed (%s); reading it line by line", name, err)
        if read is not None and num_rows is not None and read.table.num_rows != num_rows:
            read = None  # the two parsers split records differently: the line-by-line one counts as the scan does
    if read is None:
        reader = tolerant_reader.read_jsonl if kind == "jsonl" else tolerant_reader.read_csv
        read = reader(text, name, encoding, line_shift)
    if num_rows is not None and read.table.num_rows != num_rows:
        raise RowCountError(f"{name}: a part of {num_rows} rows read back as {read.table.num_rows}")
    return read


def _decode(data: bytes, encoding: str, name: str) -> str:
    """The part's text; each invalid byte stays as one lone surrogate so its line can be found."""
    if encoding == "utf-8":
        data = data.removeprefix(UTF8_BOM)
    try:
        return data.decode(encoding, errors="surrogateescape")
    except UnicodeDecodeError as err:  # codecs such as UTF-16 cannot escape every bad byte
        raise ValueError(f"{name} cannot be decoded as {encoding}: {err}") from None


def _fast_read(kind: str, data: bytes, name: str) -> InputTable | None:
    """pyarrow's read of the part, or None where it would round an integer (see the module
    docstring): the line-by-line reader reads such JSON exactly."""
    if kind == "jsonl":
        import pyarrow.json as pajson

        if _NOT_AN_OBJECT.search(data):
            return None
        table = pajson.read_json(io.BytesIO(data))
        if has_floating(table.schema) and _LONG_INTEGER.search(data):
            return None
        try:
            # pyarrow 26's JSON reader builds a list whose first item is null with bad offsets:
            # [null, false] reads as [false, false], [null, 1] as [1, 0]. A full validation
            # finds such arrays; the line-by-line reader reads them right.
            table.validate(full=True)
        except pa.ArrowInvalid:
            logger.info("%s: pyarrow's reader built an invalid table; reading it line by line", name)
            return None
        return InputTable(table)
    import pyarrow.csv as pacsv

    table = pacsv.read_csv(io.BytesIO(data))
    table = table.rename_columns(unique_names(table.column_names, name))
    floating = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    if floating and _LONG_INTEGER.search(data):
        return _exact_csv_columns(table, data, floating)
    return InputTable(table)


def _exact_csv_columns(table: pa.Table, data: bytes, floating: list[str]) -> InputTable:
    """``table`` with each floating column that holds a long integer cell stored as JSON text:
    the integers' digits as written, the other cells' floats."""
    import json

    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    names = table.column_names
    as_text = pacsv.read_csv(io.BytesIO(data), read_options=pacsv.ReadOptions(column_names=names, skip_rows=1),
                             convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(floating, pa.string())))
    wanted, json_columns = set(floating), set()
    for index, name in enumerate(names):
        if name not in wanted:
            continue
        cells = as_text.column(index)
        is_integer = pc.match_substring_regex(cells, _LONG_INTEGER_CELL)
        if not pc.any(is_integer).as_py():
            continue
        texts = [None if value is None else str(int(cell)) if integer else json.dumps(value)
                 for cell, integer, value in zip(cells.to_pylist(), is_integer.to_pylist(),
                                                 table.column(index).to_pylist())]
        table = table.set_column(index, name, pa.array(texts, pa.string()))
        json_columns.add(name)
    return InputTable(table, json_columns)
