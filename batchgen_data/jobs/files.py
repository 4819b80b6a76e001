"""Files of a CLI batch job's OUTPUT: parts, atomic part files read back before they count, the lock.

A job splits every input file into parts of ``rows_per_part`` rows. A part's output file is
named after its input file index and first row (``part-00003-000000512.parquet``) and appears
only complete and readable (written to a temporary name, read back, then renamed), so a part
exists in OUTPUT exactly when it is done: a rerun with the same OUTPUT skips done parts and
redoes the rest, and every input row comes out exactly once, keyed by (input file, row number).

OUTPUT has one owner at a time: a job holds an OS lock on ``OUTPUT/.batchgen.lock`` from before
it reads the manifest until it ends. The kernel releases it when the process dies, so a rerun
after ``kill -9`` takes it at once, and a second job started meanwhile is refused.
OUTPUT is checked before any work: a file, an unwritable place, the parts of another job there,
or a place inside the input folder is a one-line error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import BatchGenError, ConfigError

OUTPUT_FORMATS = ("parquet", "jsonl")
MANIFEST = "_batchgen_job.json"
SKIPPED = "_skipped.json"
LOCK = ".batchgen.lock"  # hidden: readers of the folder (pyarrow, datasets) skip it
USAGE = "_usage.json"  # the job's token usage (``usage.py``)
_JOB_FILES = (MANIFEST, SKIPPED, USAGE)


class OutputPathError(BatchGenError, OSError):
    """OUTPUT cannot hold the job's parts (it is a file, not writable, the disk is full)."""


class OutputInUseError(BatchGenError, RuntimeError):
    """Another job holds OUTPUT."""


@dataclass(slots=True, frozen=True)
class Part:
    file_index: int
    start_row: int
    num_rows: int

    def output_name(self, fmt: str) -> str:
        return f"part-{self.file_index:05d}-{self.start_row:09d}.{fmt}"


def check_output(output: Path, input_path: Path | None = None) -> None:
    """Check OUTPUT can take this job's parts, before any work."""
    if input_path is not None and input_path.is_dir():
        inside, folder = output.resolve(), input_path.resolve()
        if inside == folder or folder in inside.parents:
            raise OutputPathError(f"OUTPUT {output} is inside the input folder {input_path}; give an OUTPUT "
                                  "folder outside it")
    if not output.exists():
        ancestor = next(p for p in output.absolute().parents if p.exists())
        if not ancestor.is_dir():
            raise OutputPathError(f"cannot create OUTPUT {output}: {ancestor} is a file, not a folder")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise OutputPathError(f"cannot create OUTPUT {output}: {ancestor} is not writable")
        return
    if not output.is_dir():
        raise OutputPathError(f"OUTPUT {output} is a file, not a folder; give a new folder, or this job's folder to resume it")
    if not os.access(output, os.W_OK | os.X_OK):
        raise OutputPathError(f"OUTPUT {output} is not writable")


@contextlib.contextmanager
def locked_output(output: Path) -> Iterator[bool]:
    """Create OUTPUT if needed and hold its lock while the block runs; yields whether OUTPUT was
    created here. If it was and the block fails before any part is written, it is removed again."""
    created = not output.exists()
    try:
        output.mkdir(parents=True, exist_ok=True)
        fd = os.open(output / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise OutputPathError(f"cannot write to OUTPUT {output}: {err.strerror or err}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise OutputPathError(f"cannot lock OUTPUT {output}: {err.strerror or err}") from None
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            raise OutputInUseError(f"OUTPUT {output} is in use by another batchgen-data job"
                                   f"{f' (pid {holder})' if holder else ''}; wait for it to end, or give another OUTPUT")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield created
        except BaseException:
            if created and not any(p.name.startswith("part-") for p in output.iterdir()):
                shutil.rmtree(output, ignore_errors=True)
            raise
    finally:
        os.close(fd)  # releases the lock


def read_manifest_path(output: Path) -> Path | None:
    """The manifest of the job in OUTPUT, if any; part files without one are another job's."""
    path = output / MANIFEST
    if path.is_file():
        return path
    if any(p.name.startswith("part-") for p in output.iterdir()):
        raise ConfigError(f"{output} holds part files but no {MANIFEST}, so they are another job's; "
                          "use a new OUTPUT folder, delete them, or pass --overwrite")
    return None


def clear_output(output: Path) -> None:
    """``--overwrite``: remove a previous job's parts and job files (nothing else) from OUTPUT."""
    try:
        for path in output.iterdir():
            if path.name.startswith(("part-", ".tmp-")) or path.name in _JOB_FILES:
                path.unlink()
    except OSError as err:
        raise OutputPathError(f"cannot clear OUTPUT {output}: {err.strerror or err}") from None


def open_output(output: Path, manifest_json: str, skipped: list[dict]) -> set[str]:
    """Record the job in OUTPUT (created and locked by ``locked_output``) and the input files
    skipped this run in ``_skipped.json`` (none: no such file); the names of the parts done."""
    try:
        atomic_write_bytes(output / MANIFEST, manifest_json.encode())
        if skipped:
            atomic_write_bytes(output / SKIPPED, json.dumps(skipped, indent=2).encode())
        else:
            (output / SKIPPED).unlink(missing_ok=True)
    except OSError as err:
        raise OutputPathError(f"cannot write to OUTPUT {output}: {err.strerror or err}") from None
    return {p.name for p in output.iterdir() if p.name.startswith("part-")}


def remove_stale_temporaries(output: Path) -> None:
    """Parts (and input copies) being written when the last run died."""
    try:
        for stale in output.glob(".tmp-*"):
            stale.unlink()
    except OSError as err:
        raise OutputPathError(f"cannot write to OUTPUT {output}: {err.strerror or err}") from None


def write_part(output: Path, part: Part, table: pa.Table, fmt: str) -> Path:
    """Write one finished part atomically (temporary name, fsync, read back, rename). A part that
    cannot be written or read back is an ``OutputPathError`` and leaves nothing that counts as done."""
    final = output / part.output_name(fmt)
    tmp = output / f".tmp-{final.name}"
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in table.to_pylist():
                    f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _check_readable(tmp, table, fmt)
        os.replace(tmp, final)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputPathError(f"cannot write {final.name} to OUTPUT {output}: {err.strerror or err}; "
                              "fix that and run the same command again to resume") from None
    return final


def _check_readable(path: Path, table: pa.Table, fmt: str) -> None:
    """Read the part back (row count, schema): a part no reader can open must not count as done."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            written = pq.ParquetFile(path)
            rows, same = written.metadata.num_rows, written.schema_arrow.equals(table.schema)
        else:
            with open(path, encoding="utf-8") as f:
                rows, same = len([json.loads(line) for line in f]), True  # each line parses
    except (pa.ArrowException, ValueError) as err:
        raise OSError(f"the part written cannot be read back ({err})") from None
    if rows != table.num_rows or not same:
        raise OSError(f"the part written reads back as {rows} rows (of {table.num_rows})"
                      f"{'' if same else ' in another schema'}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
