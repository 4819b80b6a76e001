"""One input file as an Arrow table: pyarrow's fast readers first, a line-by-line reader after.

Parquet is read by pyarrow. JSONL and CSV are decoded first (UTF-8 unless the job names another
encoding; a UTF-8 BOM is dropped). A file that decodes cleanly goes to pyarrow's fast reader; one
with invalid bytes, or one pyarrow rejects (a malformed line, a column of mixed types, a CSV row
with the wrong number of fields), is read line by line (``tolerant_reader``), where each bad line
becomes an error row and every other line reads as it would have.
"""

from __future__ import annotations

import codecs
import io
import logging
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import ConfigError
from batchgen_data.jobs import tolerant_reader
from batchgen_data.jobs.input_table import BAD_BYTES, InputTable, unique_names

logger = logging.getLogger(__name__)

INPUT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
UTF8_BOM = codecs.BOM_UTF8


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
    """Read one input file. Raises ``OSError`` or ``pyarrow.ArrowException`` when the file
    cannot be read at all (the job reports it as a bad file); bad lines become error rows."""
    kind = input_kind(path)
    if kind is None:
        raise ValueError(f"{path.name}: unsupported file type {path.suffix!r}")
    if kind == "parquet":
        import pyarrow.parquet as pq

        # A zero-byte file (created, never written) has zero rows, like an empty JSONL.
        return InputTable(pa.table({}) if path.stat().st_size == 0 else pq.read_table(path))
    data = path.read_bytes()
    text = _decode(data, encoding, path.name)
    if not text.strip():
        return InputTable(pa.table({}))
    if not BAD_BYTES.search(text):
        clean = data.removeprefix(UTF8_BOM) if encoding == "utf-8" else text.encode("utf-8")
        try:
            return InputTable(_fast_read(kind, clean, path.name))
        except pa.ArrowException as err:
            logger.info("%s: pyarrow's reader failed (%s); reading it line by line", path.name, err)
    read = tolerant_reader.read_jsonl if kind == "jsonl" else tolerant_reader.read_csv
    return read(text, path.name, encoding)


def _decode(data: bytes, encoding: str, name: str) -> str:
    """The file's text; each invalid byte stays as one lone surrogate so its line can be found."""
    if encoding == "utf-8":
        data = data.removeprefix(UTF8_BOM)
    try:
        return data.decode(encoding, errors="surrogateescape")
    except UnicodeDecodeError as err:  # codecs such as UTF-16 cannot escape every bad byte
        raise ValueError(f"{name} cannot be decoded as {encoding}: {err}") from None


def _fast_read(kind: str, data: bytes, name: str) -> pa.Table:
    if kind == "jsonl":
        import pyarrow.json as pajson

        return pajson.read_json(io.BytesIO(data))
    import pyarrow.csv as pacsv

    table = pacsv.read_csv(io.BytesIO(data))
    return table.rename_columns(unique_names(table.column_names, name))
