"""Files of a CLI batch job's OUTPUT: parts, atomic part files, the resume manifest.

A job splits every input file into parts of ``rows_per_part`` rows. A part's output file is
named after its input file index and first row (``part-00003-000000512.parquet``) and appears
only complete (written to a temporary name, then renamed), so a part exists in OUTPUT exactly
when it is done: a rerun with the same OUTPUT skips done parts and redoes the rest, and every
input row comes out exactly once, keyed by (input file, row number). OUTPUT is checked before any
work: a file, an unwritable place, or the parts of another job there is a one-line error.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import BatchGenError, ConfigError

OUTPUT_FORMATS = ("parquet", "jsonl")
MANIFEST = "_batchgen_job.json"
SKIPPED = "_skipped.json"


class OutputPathError(BatchGenError, OSError):
    """OUTPUT cannot hold the job's parts (it is a file, or not writable)."""


@dataclass(slots=True, frozen=True)
class Part:
    file_index: int
    start_row: int
    num_rows: int

    def output_name(self, fmt: str) -> str:
        return f"part-{self.file_index:05d}-{self.start_row:09d}.{fmt}"


@dataclass(slots=True)
class JobManifest:
    """What identifies a job: rerunning with a different one into the same OUTPUT is an error.

    ``skipped`` names the input files a ``--skip-bad-files`` run could not read. None of their
    parts is in OUTPUT, so a rerun reads them again, and may process them once fixed even if
    their size changed; ``columns`` (each column's type) makes sure such a rerun cannot add parts
    whose columns differ from the parts already there.
    """

    inputs: list[str]
    input_sizes: list[int]
    rows_per_part: int
    output_format: str
    encoding: str = "utf-8"
    skipped: list[str] = field(default_factory=list)
    columns: dict[str, str] | None = None

    def check_same_inputs(self, previous: JobManifest, output: Path) -> None:
        """Before reading any input: the same files and sizes (but of files skipped before) and options."""
        changes = []
        if self.inputs != previous.inputs:
            changes.append(f"input files {previous.inputs} then, {self.inputs} now")
        else:
            resized = [name for name, old, new in zip(self.inputs, previous.input_sizes, self.input_sizes)
                       if old != new and name not in previous.skipped]
            if resized:
                changes.append(f"input files changed size: {resized}")
        for name in ("rows_per_part", "output_format", "encoding"):
            old, new = getattr(previous, name), getattr(self, name)
            if old != new:
                changes.append(f"{name} {old!r} then, {new!r} now")
        if changes:
            raise ConfigError(f"{output} holds parts of a different job ({'; '.join(changes)}); "
                              "use a new OUTPUT folder or delete it")

    def check_same_columns(self, previous: JobManifest, output: Path) -> None:
        """After reading the inputs: parts written now would have the columns of those there."""
        if previous.columns is None or self.columns == previous.columns or not any(output.glob("part-*")):
            return
        changed = sorted(k for k in {**previous.columns, **(self.columns or {})}
                         if previous.columns.get(k) != (self.columns or {}).get(k))
        raise ConfigError(f"{output} holds parts of a different job (the inputs now give other columns: {changed}, "
                          "e.g. a file skipped before reads now); use a new OUTPUT folder or delete it")


def check_output(output: Path) -> JobManifest | None:
    """Check OUTPUT can take this job's parts, before any work; the manifest of the job in it, if any."""
    if not output.exists():
        ancestor = next(p for p in output.absolute().parents if p.exists())
        if not ancestor.is_dir():
            raise OutputPathError(f"cannot create OUTPUT {output}: {ancestor} is a file, not a folder")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise OutputPathError(f"cannot create OUTPUT {output}: {ancestor} is not writable")
        return None
    if not output.is_dir():
        raise OutputPathError(f"OUTPUT {output} is a file, not a folder; give a new folder, or this job's folder to resume it")
    if not os.access(output, os.W_OK | os.X_OK):
        raise OutputPathError(f"OUTPUT {output} is not writable")
    path = output / MANIFEST
    if path.is_file():
        try:
            return JobManifest(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"{path} cannot be read as a job manifest ({err}); use a new OUTPUT folder or delete it") from None
    if any(p.name.startswith("part-") for p in output.iterdir()):
        raise ConfigError(f"{output} holds part files but no {MANIFEST}, so they are another job's; "
                          "use a new OUTPUT folder or delete them")
    return None


def plan_parts(num_rows_per_file: list[int], rows_per_part: int) -> list[Part]:
    return [
        Part(i, start, min(rows_per_part, n - start))
        for i, n in enumerate(num_rows_per_file)
        for start in range(0, n, rows_per_part)
    ]


def open_output(output: Path, manifest: JobManifest, skipped: list[dict]) -> set[str]:
    """Create OUTPUT (checked by ``check_output``), record the job in it and the input files
    skipped this run in ``_skipped.json`` (none: no such file); the names of the parts done."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(output / MANIFEST, json.dumps(asdict(manifest), indent=2).encode())
        if skipped:
            _atomic_write_bytes(output / SKIPPED, json.dumps(skipped, indent=2).encode())
        else:
            (output / SKIPPED).unlink(missing_ok=True)
        for stale in output.glob(".tmp-*"):
            stale.unlink()  # a part being written when the last run died
    except OSError as err:
        raise OutputPathError(f"cannot write to OUTPUT {output}: {err.strerror or err}") from None
    return {p.name for p in output.iterdir() if p.name.startswith("part-")}


def write_part(output: Path, part: Part, table: pa.Table, fmt: str) -> Path:
    """Write one finished part atomically (temporary name, fsync, rename)."""
    final = output / part.output_name(fmt)
    tmp = output / f".tmp-{final.name}"
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
