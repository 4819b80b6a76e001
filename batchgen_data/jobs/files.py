"""Files of a CLI batch job: input discovery, parts, atomic output parts and the resume manifest.

A job splits every input file into parts of ``rows_per_part`` rows. A part's output file is
named after its input file index and first row (``part-00003-000000512.parquet``) and appears
only complete (written to a temporary name, then renamed), so a part exists in OUTPUT exactly
when it is done: a rerun with the same OUTPUT skips done parts and redoes the rest, and every
input row comes out exactly once, keyed by (input file, row number).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from batchgen_data.errors import ConfigError

INPUT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
OUTPUT_FORMATS = ("parquet", "jsonl")
MANIFEST = "_batchgen_job.json"


@dataclass(slots=True, frozen=True)
class Part:
    file_index: int
    start_row: int
    num_rows: int

    def output_name(self, fmt: str) -> str:
        return f"part-{self.file_index:05d}-{self.start_row:09d}.{fmt}"


@dataclass(slots=True)
class JobManifest:
    """What identifies a job: rerunning with a different one into the same OUTPUT is an error."""

    inputs: list[str]
    input_sizes: list[int]
    rows_per_part: int
    output_format: str

    def check_same(self, other: JobManifest, output: Path) -> None:
        if self != other:
            raise ConfigError(
                f"{output} holds the output of a different job ({output / MANIFEST} differs: inputs, "
                "rows_per_part or output format changed); use a new OUTPUT folder or delete it"
            )


def discover_inputs(path: str | Path) -> list[Path]:
    """A file, or every supported file in a folder (sorted, non-recursive)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in INPUT_SUFFIXES and not p.name.startswith("."))
    else:
        raise ConfigError(f"input {str(path)!r} does not exist")
    if not files:
        raise ConfigError(f"no input files ({', '.join(INPUT_SUFFIXES)}) in {str(path)!r}")
    bad = [str(f) for f in files if f.suffix not in INPUT_SUFFIXES]
    if bad:
        raise ConfigError(f"unsupported input file type(s) {bad}; supported: {sorted(INPUT_SUFFIXES)}")
    return files


def read_table(path: Path) -> pa.Table:
    kind = INPUT_SUFFIXES[path.suffix]
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if kind == "csv":
        import pyarrow.csv as pacsv

        return pacsv.read_csv(path)
    import pyarrow.json as pajson

    return pajson.read_json(path)


def plan_parts(num_rows_per_file: list[int], rows_per_part: int) -> list[Part]:
    return [
        Part(i, start, min(rows_per_part, n - start))
        for i, n in enumerate(num_rows_per_file)
        for start in range(0, n, rows_per_part)
    ]


def open_output(output: Path, manifest: JobManifest) -> set[str]:
    """Create or validate OUTPUT; return the names of the parts already done."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / MANIFEST
    if path.is_file():
        manifest.check_same(JobManifest(**json.loads(path.read_text())), output)
    else:
        _atomic_write_bytes(path, json.dumps(asdict(manifest), indent=2).encode())
    for stale in output.glob(".tmp-*"):
        stale.unlink()  # a part being written when the last run died
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
