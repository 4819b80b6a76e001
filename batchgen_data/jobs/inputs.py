"""The job's input files: discovery, the check of every file before the model loads, loading.

A file that cannot be read at all (a truncated Parquet file, an unreadable file, an unknown
extension in a folder) stops the job with one message listing every such file and why, before
anything is generated; with ``skip_bad_files`` the job processes the rest and reports the skipped
ones. A file that reads has every line in its table, bad lines as error rows (``readers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import BatchGenError, ConfigError
from batchgen_data.jobs.input_table import InputTable
from batchgen_data.jobs.job_schema import unify
from batchgen_data.jobs.readers import INPUT_SUFFIXES, input_kind, read_input

# Names a folder listing skips: hidden files and writers' markers (Spark's ``_SUCCESS``, ``.crc``
# checksums), the prefixes pyarrow datasets skip too.
IGNORED_PREFIXES = (".", "_")


class InputFilesError(BatchGenError, ValueError):
    """Input files cannot be read; the message lists each one and why."""


@dataclass(slots=True, frozen=True)
class BadInput:
    file: str
    reason: str


@dataclass(slots=True)
class JobInputs:
    """Per input file, its table (None for a skipped file), all of one schema."""

    files: list[Path]
    tables: list[pa.Table | None]
    json_columns: list[str]
    column_types: dict[str, str]
    bad: list[BadInput]

    def empty_files(self) -> list[str]:
        return [str(f) for f, t in zip(self.files, self.tables) if t is not None and t.num_rows == 0]


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
    """Why ``path`` cannot be read, or None: the file type, the Parquet footer, that it opens."""
    kind = input_kind(path)
    if kind is None:
        return f"unsupported file type {path.suffix or '(no extension)'!r}; supported: {', '.join(INPUT_SUFFIXES)}"
    try:
        if kind == "parquet" and path.stat().st_size > 0:
            import pyarrow.parquet as pq

            pq.ParquetFile(path).metadata  # reads the footer only: a truncated file has none
        else:
            with open(path, "rb") as f:
                f.read(1)
    except (OSError, pa.ArrowException) as err:
        return _reason(err)
    return None


def load_inputs(files: list[Path], encoding: str, skip_bad_files: bool = False) -> JobInputs:
    """Check every file, then read the good ones; bad files raise ``InputFilesError`` (listing
    all of them) unless ``skip_bad_files``."""
    bad = [BadInput(str(f), reason) for f in files if (reason := check_input(f)) is not None]
    if bad and not skip_bad_files:
        raise InputFilesError(_bad_files_message(bad, len(files)))  # before reading any large file
    skipped = {b.file for b in bad}
    read: list[InputTable | None] = []
    for f in files:
        table = None
        if str(f) not in skipped:
            try:
                table = read_input(f, encoding)
            except (OSError, ValueError, pa.ArrowException) as err:  # a corrupt page, undecodable text
                bad.append(BadInput(str(f), _reason(err)))
        read.append(table)
    if bad and not skip_bad_files:
        raise InputFilesError(_bad_files_message(bad, len(files)))
    unified = unify([t for t in read if t is not None])
    tables = iter(unified.tables)
    return JobInputs(files=files, tables=[None if t is None else next(tables) for t in read], json_columns=unified.json_columns,
                     column_types=unified.column_types(), bad=sorted(bad, key=lambda b: b.file))


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"cannot read it ({err.strerror})"
    return f"cannot read it ({err})"


def _bad_files_message(bad: list[BadInput], num_files: int) -> str:
    lines = [f"{len(bad)} of {num_files} input files cannot be read; nothing was generated "
             "(fix or remove them, or pass --skip-bad-files to process the others):"]
    lines += [f"  {b.file}: {b.reason}" for b in sorted(bad, key=lambda b: b.file)]
    return "\n".join(lines)
