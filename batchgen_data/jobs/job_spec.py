"""What a ``run`` job is asked to do: its input, OUTPUT, stage and how its parts run. Plain data
(the CLI builds it from flags before anything heavy is imported)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchgen_data.operators.rows import StageConfig


@dataclass(slots=True)
class JobSpec:
    input: Path
    output: Path
    stage: StageConfig
    rows_per_part: int = 256
    output_format: str = "parquet"
    workers: int = 1
    address: str | None = None
    batch_size: int = 64
    max_concurrent_batches: int = 4
    cpus_per_worker: float | None = None
    show_progress: bool = True
    encoding: str | None = None  # of JSONL and CSV inputs; None: UTF-8
    skip_bad_files: bool = False  # process the readable files instead of stopping on a bad one
    overwrite: bool = False  # start over in an OUTPUT that holds another job's parts
