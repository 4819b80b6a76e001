"""A JSONL or CSV input file as byte ranges of ``rows_per_part`` rows, read in one streaming pass.

A job never holds a whole input file: the scan reads each file once, front to back, and cuts it
into chunks of ``rows_per_part`` rows (the job's parts), recording where each starts in the file,
so a part is read again later with one seek. The same pass hashes the file's bytes (the job
manifest's identity of the input).

What counts as a row is what the readers make one: a JSONL row is a line that is not blank (lines
end at "\\n" only; a line of whitespace gives no row), a CSV row is a record after the header (it
may span lines inside quotes; Python's ``csv`` finds where it ends, as the line-by-line reader
does, with lines ending at "\\n", "\\r\\n" or a lone "\\r"). Splitting bytes at line ends is right
for every ASCII-compatible encoding; a file in another one (UTF-16, UTF-32) is first transcoded
to a UTF-8 copy (``transcode_to_utf8``).
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

UTF8_BOM = codecs.BOM_UTF8
_BLOCK = 1 << 20
_LINE_END = re.compile(rb"\r\n|\r|\n")
# A line whose first non-space byte is one of these has text: no decoding needed to know it.
_TEXT_START = frozenset(b'{["-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ')


@dataclass(slots=True, frozen=True)
class TextChunk:
    """One part's bytes in its file: ``length`` bytes from ``offset``, whose first line is
    ``first_line`` (1-based) and which hold ``num_rows`` rows."""

    offset: int
    length: int
    first_line: int
    num_rows: int


@dataclass(slots=True)
class TextScan:
    """What a scan learns besides the chunks: the CSV header record (its bytes from the file's
    start, blank lines before it included, and how many lines they span) and the file's SHA-256."""

    header: bytes = b""
    header_lines: int = 0
    sha256: str = ""


def is_ascii_compatible(encoding: str) -> bool:
    """Whether every ASCII character is the same single byte in ``encoding`` (so lines can be
    split at ``b"\\n"`` before decoding)."""
    try:
        return all(chr(i).encode(encoding) == bytes([i]) for i in range(128))
    except (UnicodeError, LookupError):
        return False


def transcode_to_utf8(source: Path, encoding: str, target: Path) -> None:
    """Write ``source`` (in ``encoding``) to ``target`` as UTF-8, streamed. Raises ``ValueError``
    when the text cannot be decoded (codecs such as UTF-16 cannot escape every bad byte)."""
    decoder = codecs.getincrementaldecoder(encoding)(errors="surrogateescape")
    try:
        with open(source, "rb") as src, open(target, "wb") as dst:
            while block := src.read(_BLOCK):
                dst.write(decoder.decode(block).encode("utf-8", errors="surrogateescape"))
            dst.write(decoder.decode(b"", final=True).encode("utf-8", errors="surrogateescape"))
    except UnicodeError as err:
        raise ValueError(f"{source.name} cannot be decoded as {encoding}: {err}") from None


def scan_text(path: Path, kind: str, encoding: str, rows_per_part: int, scan: TextScan) -> Iterator[tuple[TextChunk, bytes]]:
    """Each chunk of ``path`` with its bytes, in file order; ``scan`` is filled as the file is read
    (its ``sha256`` once the iteration ends). ``encoding`` must be ASCII-compatible."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        units = _jsonl_units(f, encoding, digest) if kind == "jsonl" else _csv_units(f, encoding, digest, scan)
        pieces: list[bytes] = []
        offset = start = 0
        first_line = line = 1
        rows = 0
        for data, num_lines, is_row in units:
            if is_row is None:  # the CSV header: in ``scan``, not in a chunk
                offset += len(data)
                line += num_lines
                continue
            if not pieces:
                start, first_line = offset, line
            pieces.append(data)
            offset += len(data)
            line += num_lines
            rows += is_row
            if rows == rows_per_part:
                yield TextChunk(start, offset - start, first_line, rows), b"".join(pieces)
                pieces, rows = [], 0
        if rows:  # blank lines after the last row make no chunk
            yield TextChunk(start, offset - start, first_line, rows), b"".join(pieces)
    scan.sha256 = digest.hexdigest()


def _jsonl_units(f, encoding: str, digest) -> Iterator[tuple[bytes, int, bool]]:
    """(line bytes, 1, whether it is a row) for each line of a JSONL file."""
    first = True
    for raw in f:
        digest.update(raw)
        text = raw.removeprefix(UTF8_BOM) if first and encoding == "utf-8" else raw
        first = False
        yield raw, 1, not _is_blank(text, encoding)


def _is_blank(raw: bytes, encoding: str) -> bool:
    """Whether the line reads as blank (``str.strip`` leaves nothing, as the readers test it)."""
    stripped = raw.strip()
    if not stripped:
        return True
    if stripped[0] in _TEXT_START:
        return False
    return not raw.decode(encoding, errors="surrogateescape").strip()


def _universal_lines(f) -> Iterator[bytes]:
    """The file's lines split as Python's universal newlines split them (``\\n``, ``\\r\\n`` and a
    lone ``\\r``, as in old Mac CSV files), each with its line end."""
    pending = b""
    while block := f.read(_BLOCK):
        data, start = pending + block, 0
        for match in _LINE_END.finditer(data):
            if match.end() == len(data) and match.group() == b"\r":
                break  # a "\r" at the end of the block may be half of a "\r\n"
            yield data[start:match.end()]
            start = match.end()
        pending = data[start:]
    if pending:
        yield pending


def _csv_units(f, encoding: str, digest, scan: TextScan) -> Iterator[tuple[bytes, int, bool | None]]:
    """(record bytes, lines it spans, whether it is a row) for each CSV record; the header (and
    blank lines before it) also goes to ``scan``, and is yielded with None."""
    consumed: list[bytes] = []

    def lines():
        first = True
        for raw in _universal_lines(f):
            digest.update(raw)
            consumed.append(raw)
            text = raw.removeprefix(UTF8_BOM) if first and encoding == "utf-8" else raw
            first = False
            yield text.decode(encoding, errors="surrogateescape")

    reader = csv.reader(lines())
    seen_header = False
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error:  # an unreadable record is still one row (an error row)
            cells = None
        data, num_lines = b"".join(consumed), len(consumed)
        consumed.clear()
        if not seen_header:
            scan.header += data
            scan.header_lines += num_lines
            seen_header = cells != []
            yield data, num_lines, None
            continue
        yield data, num_lines, cells != []
    if consumed:  # lines the csv reader took but gave no record for
        yield b"".join(consumed), len(consumed), False
