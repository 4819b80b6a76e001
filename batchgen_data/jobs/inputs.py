"""The job's input files: discovery, the check of every file, the scan into parts, reading a part.

Everything is checked before the model loads. A path that is not a regular file (a FIFO, a
device, a link to one) or cannot be read at all (a truncated Parquet file, an unknown extension
in a folder) stops the job with one message listing every such file and why; with
``skip_bad_files`` the job processes the rest and reports the skipped ones.

No input is ever held whole: ``scan_inputs`` reads each file once, streaming, to count its rows,
cut it into parts, learn the job's schema (``job_schema``) and hash its bytes (the manifest's
identity of the file); ``PartSource.read`` reads one part again when it runs. Memory is bounded
by the parts in flight, not by the input.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import BatchGenError, ConfigError
from batchgen_data.jobs.files import Part
from batchgen_data.jobs.input_table import InputTable
from batchgen_data.jobs.job_schema import JobSchema, SchemaBuilder
from batchgen_data.jobs.readers import INPUT_SUFFIXES, input_kind, read_parquet_rows, read_text
from batchgen_data.jobs.text_chunks import (
    TextChunk,
    TextScan,
    is_ascii_compatible,
    scan_text,
    transcode_to_utf8,
)

# Names a folder listing skips: hidden files and writers' markers (Spark's ``_SUCCESS``, ``.crc``
# checksums), the prefixes pyarrow datasets skip too.
IGNORED_PREFIXES = (".", "_")
_FILE_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


class InputFilesError(BatchGenError, ValueError):
    """Input files cannot be read; the message lists each one and why."""


@dataclass(slots=True, frozen=True)
class BadInput:
    file: str
    reason: str


@dataclass(slots=True, frozen=True)
class PartSource:
    """Where one part's rows are: rows of a Parquet file, or a byte range of a JSONL / CSV file
    (with the CSV header record)."""

    path: str
    kind: str
    encoding: str
    start_row: int
    num_rows: int
    chunk: TextChunk | None = None
    header: bytes = b""
    header_lines: int = 0

    def read(self) -> InputTable:
        path = Path(self.path)
        if self.chunk is None:
            return read_parquet_rows(path, self.start_row, self.num_rows)
        with open(path, "rb") as f:
            f.seek(self.chunk.offset)
            data = f.read(self.chunk.length)
        return read_text(self.kind, data, path.name, self.encoding, self.chunk.first_line, self.header,
                         self.header_lines, self.num_rows)


@dataclass(slots=True)
class JobInputs:
    """The job's parts, where each one's rows are, the schema every part is written in, each
    file's SHA-256 (None for a skipped file), and the bad files."""

    files: list[Path]
    parts: list[Part]
    sources: list[PartSource]
    schema: JobSchema
    sha256: list[str | None]
    bad: list[BadInput]
    empty: list[str] = field(default_factory=list)

    def read_part(self, index: int) -> pa.Table:
        """Part ``index``'s rows in the job's schema."""
        return self.schema.conform(self.sources[index].read())


def discover_inputs(path: str | Path) -> list[Path]:
    """A file, or every entry of a folder (sorted, non-recursive) but subfolders and names
    starting with ``.`` or ``_``. Entries of an unknown type are kept: ``check_input`` reports them."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if not p.name.startswith(IGNORED_PREFIXES) and not p.is_dir())
        if not files:
            raise ConfigError(f"no input files ({', '.join(INPUT_SUFFIXES)}) in {str(path)!r}")
        return files
    if path.exists() or path.is_symlink():
        return [path]
    raise ConfigError(f"input {str(path)!r} does not exist")


def check_input(path: Path) -> str | None:
    """Why ``path`` cannot be read, or None: a regular file (links followed), of a known type,
    whose Parquet footer reads and which opens. Never opens anything but a regular file (a FIFO
    would block the job, a device would read forever)."""
    kind = input_kind(path)
    if kind is None:
        return f"unsupported file type {path.suffix or '(no extension)'!r}; supported: {', '.join(INPUT_SUFFIXES)}"
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            what = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
            return f"not a regular file: {what}{' (through a link)' if path.is_symlink() else ''}"
        if kind == "parquet" and path.stat().st_size > 0:
            import pyarrow.parquet as pq

            pq.ParquetFile(path).metadata  # reads the footer only: a truncated file has none
        else:
            with open(path, "rb") as f:
                f.read(1)
    except (OSError, pa.ArrowException) as err:
        return _reason(err)
    return None


def scan_inputs(files: list[Path], encoding: str, rows_per_part: int, skip_bad_files: bool = False,
                scratch: Path | None = None) -> JobInputs:
    """Check every file, then scan the good ones into parts; bad files raise ``InputFilesError``
    (listing all of them) unless ``skip_bad_files``. ``scratch``: a folder for UTF-8 copies of
    files in encodings that are not ASCII-compatible (UTF-16, UTF-32)."""
    bad = [BadInput(str(f), reason) for f in files if (reason := check_input(f)) is not None]
    if bad and not skip_bad_files:
        raise InputFilesError(_bad_files_message(bad, len(files)))  # before reading any large file
    skipped = {b.file for b in bad}
    builder = SchemaBuilder()
    parts: list[Part] = []
    sources: list[PartSource] = []
    digests: list[str | None] = []
    empty: list[str] = []
    for index, f in enumerate(files):
        digest = None
        if str(f) not in skipped:
            try:
                file_builder, file_sources, digest = _scan_file(f, encoding, rows_per_part, scratch, index)
            except (OSError, ValueError, pa.ArrowException) as err:  # a corrupt page, undecodable text
                bad.append(BadInput(str(f), _reason(err)))
            else:
                builder.merge(file_builder)
                sources += file_sources
                parts += [Part(index, s.start_row, s.num_rows) for s in file_sources]
                if not file_sources:
                    empty.append(str(f))
        digests.append(digest)
    if bad and not skip_bad_files:
        raise InputFilesError(_bad_files_message(bad, len(files)))
    return JobInputs(files=files, parts=parts, sources=sources, schema=builder.finish(), sha256=digests,
                     bad=sorted(bad, key=lambda b: b.file), empty=empty)


def _scan_file(path: Path, encoding: str, rows_per_part: int, scratch: Path | None,
               index: int) -> tuple[SchemaBuilder, list[PartSource], str]:
    builder = SchemaBuilder()
    kind = input_kind(path)
    if kind == "parquet":
        return (builder, *_scan_parquet(path, rows_per_part, builder))
    if not is_ascii_compatible(encoding):
        if scratch is None:
            raise ValueError(f"{path.name}: the {encoding} encoding needs a scratch folder")
        copy = scratch / f".tmp-input-{index:05d}{path.suffix}"
        transcode_to_utf8(path, encoding, copy)
        read_path, read_encoding = copy, "utf-8"
    else:
        read_path, read_encoding = path, encoding
    scan, sources, start = TextScan(), [], 0
    for chunk, data in scan_text(read_path, kind, read_encoding, rows_per_part, scan):
        builder.add(read_text(kind, data, path.name, read_encoding, chunk.first_line, scan.header,
                              scan.header_lines, chunk.num_rows))
        sources.append(PartSource(str(read_path), kind, read_encoding, start, chunk.num_rows, chunk))
        start += chunk.num_rows
    header = scan.header
    sources = [PartSource(s.path, s.kind, s.encoding, s.start_row, s.num_rows, s.chunk, header, scan.header_lines)
               for s in sources] if kind == "csv" else sources
    return builder, sources, scan.sha256


def _scan_parquet(path: Path, rows_per_part: int, builder: SchemaBuilder) -> tuple[list[PartSource], str]:
    """A Parquet file's parts from its footer alone; its integer columns' ranges from the row
    groups' statistics."""
    import pyarrow.parquet as pq

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    digest = digest.hexdigest()
    if path.stat().st_size == 0:
        return [], digest
    parquet = pq.ParquetFile(path)
    builder.add_schema(parquet.schema_arrow, _integer_ranges(parquet))
    num_rows = parquet.metadata.num_rows
    sources = [PartSource(str(path), "parquet", "", start, min(rows_per_part, num_rows - start))
               for start in range(0, num_rows, rows_per_part)]
    return sources, digest


def _integer_ranges(parquet) -> dict[str, tuple[int, int] | None]:
    """Each top-level column's integer range over its leaves from the row groups' statistics
    (None for a column with an integer leaf that has none)."""
    metadata = parquet.metadata
    ranges: dict[str, tuple[int, int] | None] = {}
    missing: set[str] = set()
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            if column.physical_type not in ("INT32", "INT64") or column.num_values == 0:
                continue
            name = column.path_in_schema.split(".")[0]
            stats = column.statistics
            if stats is None or not stats.has_min_max:
                if stats is None or stats.null_count != column.num_values:
                    missing.add(name)
                continue
            low, high = int(stats.min), int(stats.max)
            old = ranges.get(name)
            ranges[name] = (low, high) if old is None else (min(old[0], low), max(old[1], high))
    for name in missing:
        ranges[name] = None
    return ranges


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"cannot read it ({err.strerror})"
    return f"cannot read it ({err})"


def _bad_files_message(bad: list[BadInput], num_files: int) -> str:
    lines = [f"{len(bad)} of {num_files} input files cannot be read; nothing was generated "
             "(fix or remove them, or pass --skip-bad-files to process the others):"]
    lines += [f"  {b.file}: {b.reason}" for b in sorted(bad, key=lambda b: b.file)]
    return "\n".join(lines)
