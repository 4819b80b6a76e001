"""A job's token usage: what every ``run`` and ``run-batch`` job writes to ``_usage.json`` and
prints in its summary (rows, prompt tokens and how many came from the prefix cache, completion
tokens, error rows, wall time, tokens/s).

The totals are the whole job's, read back from its part files (so a resumed job counts the
parts an earlier run wrote); the wall time and tokens/s are this run's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq

from batchgen_data.jobs.files import USAGE, atomic_write_bytes
from batchgen_data.operators.columns import ERROR_COLUMN

__all__ = ["USAGE", "JobUsage", "usage_of_parts", "write_usage"]
_TOKEN_COLUMNS = ("num_input_tokens", "num_cached_tokens", "num_generated_tokens")


@dataclass(slots=True)
class JobUsage:
    """Token usage of a job (``rows``: output rows; ``error_rows``: those with an error)."""

    rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0  # this run's
    run_completion_tokens: int = 0  # generated in this run (a resumed job: its remaining parts)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens this run generated per second of its wall time."""
        return self.run_completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, other: JobUsage) -> None:
        for name in ("rows", "error_rows", "prompt_tokens", "cached_prompt_tokens", "completion_tokens",
                     "run_completion_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict:
        return {**asdict(self), "total_tokens": self.total_tokens, "tokens_per_s": round(self.tokens_per_s, 3)}

    def describe(self) -> str:
        return (f"{self.rows} rows ({self.error_rows} errors), {self.prompt_tokens} prompt tokens "
                f"({self.cached_prompt_tokens} cached), {self.completion_tokens} completion tokens, "
                f"{self.wall_s:.1f} s, {self.tokens_per_s:.1f} tokens/s")


def usage_of_parts(folder: Path) -> JobUsage:
    """The totals over every part file in ``folder`` (Parquet or JSONL)."""
    usage = JobUsage()
    for path in sorted(folder.glob("part-*")):
        if path.suffix == ".parquet":
            table = pq.read_table(path, columns=[*_TOKEN_COLUMNS, ERROR_COLUMN])
            rows = {name: table.column(name).to_pylist() for name in table.column_names}
        else:
            rows = {name: [] for name in (*_TOKEN_COLUMNS, ERROR_COLUMN)}
            with open(path, encoding="utf-8") as f:
                for line in f:
                    record = json.loads(line)
                    for name in rows:
                        rows[name].append(record.get(name))
        usage.rows += len(rows[ERROR_COLUMN])
        usage.error_rows += sum(e is not None for e in rows[ERROR_COLUMN])
        usage.prompt_tokens += sum(n or 0 for n in rows["num_input_tokens"])
        usage.cached_prompt_tokens += sum(n or 0 for n in rows["num_cached_tokens"])
        usage.completion_tokens += sum(n or 0 for n in rows["num_generated_tokens"])
    return usage


def write_usage(path: Path, usage: JobUsage) -> None:
    atomic_write_bytes(path, (json.dumps(usage.to_dict(), indent=2) + "\n").encode())
