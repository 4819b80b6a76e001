"""What one simulated run is given (``SimConfig``: the stage's shape) and what it measures
(``SimResult``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimConfig:
    actors: int
    max_num_seqs: int = 256
    block_rows: int = 64
    tasks_in_flight: int = 4  # max_tasks_in_flight_per_actor (= concurrent calls); Ray Data's default is 4
    rebalance: bool = True
    seed: int = 0
    jitter: float = 0.0  # relative noise on each step's time (seeded)
    # An oracle: tail moves only once Ray Data has handed out every block. The pool cannot know
    # that; it measures what moving while blocks still come costs (docs/benchmarks.md, limit 3).
    moves_after_input: bool = False


@dataclass(frozen=True, slots=True)
class SimResult:
    makespan_s: float
    moves: int  # sequences given back at the tail and continued elsewhere
    moved_tokens: int  # tokens of KV those moves carried or recomputed
    idle_share: float  # of the actors' time from start-up to the end, the share not stepping
    rows_in_pool: int
    lease_calls: int
    steps: int
