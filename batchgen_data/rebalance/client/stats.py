"""One actor's rebalancing counters (``RebalanceClient.stats``), as its stats report writes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RebalanceStats:
    num_leased: int = 0
    num_run_for_others: int = 0
    num_fallback_batches: int = 0
    num_local_batches: int = 0  # batches run on its own engine while the stage needed no pool
    num_given_back: int = 0  # running sequences this actor handed to others at the tail
    num_adopted: int = 0  # of them, its own rows run outside the pool, whose results came back through it
    num_continued: int = 0  # sequences started elsewhere that this actor finished
    num_recomputed_tokens: int = 0  # KV rebuilt from tokens in this actor's engine
    idle_s: float = 0.0
    busy_s: float = 0.0
    num_pool_calls: int = 0  # lease calls to the coordinator
    pool_call_s: float = 0.0  # seconds this actor's loop spent in them, held ones included
    pool_held_s: float = 0.0  # of which the coordinator held them open, waiting for work
    migrated_out_bytes: int = 0  # KV shipped with the sequences it gave back
    migrate_out_s: float = 0.0  # seconds its engine spent exporting them
    calibration_s: float = 0.0  # seconds the step model's calibration took at start
    calibration_cached: bool = False  # ... read from an earlier engine's on this machine
    calibrated_base_s: float = 0.0  # its line: step seconds at n running = base + per_seq * n
    calibrated_per_seq_s: float = 0.0
    ready_wall: float = 0.0  # wall clock when its engine was built and calibrated (start-up, for benchmarks)
    first_call_wall: float = 0.0  # ... when its first batch call came
    first_items_wall: float = 0.0  # ... when its first lease brought items
    joined_pool_wall: float = 0.0  # ... when it found or started the stage's pool (0: it never needed one)
    events: list = field(default_factory=list)  # (wall time, what, seconds, count, bytes) of each move
