"""Progress reporting for batch jobs: rows and output tokens per second, and an ETA."""

from __future__ import annotations

import sys
import time


class JobProgress:
    """A tqdm bar over rows with output-token throughput in the postfix (disabled -> silent)."""

    def __init__(self, total_rows: int, done_rows: int = 0, enabled: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_rows, initial=done_rows, unit="row", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True, desc="batchgen")
        self.start = time.perf_counter()
        self.rows = 0
        self.tokens = 0
        self.errors = 0

    def update(self, num_rows: int, num_tokens: int, num_errors: int, cache_hit_rate: float = 0.0) -> None:
        """``cache_hit_rate``: the job's prefix-cache hit rate so far (prompt tokens)."""
        self.rows += num_rows
        self.tokens += num_tokens
        self.errors += num_errors
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.0f} out tok/s, prefix cache hit {cache_hit_rate:.0%}, "
                                 f"{self.errors} error rows", refresh=False)
        self.bar.update(num_rows)

    def close(self) -> None:
        self.bar.close()
