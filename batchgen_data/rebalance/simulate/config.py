"""What one simulated run is given (``SimConfig``: the stage's shape) and what it measures
(``SimResult``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimConfig:
    actors: int
    max_num_seqs: int = 256
    block_rows: int = 64
    tasks_in_flight: int = 4  # max_tasks_in_flight_per_actor: blocks Ray Data hands an actor at once
    rebalance: bool = True
    seed: int = 0
    jitter: float = 0.0  # relative noise on each step's time (seeded)
    # An oracle: tail moves only once Ray Data has handed out every block. The pool cannot know
    # that; it measures what moving while blocks still come costs (docs/benchmarks.md, limit 3).
    moves_after_input: bool = False
    # max_concurrent_calls_per_actor (Ray Data LLM's max_concurrent_batches): calls an actor runs
    # at once; blocks handed to it beyond these wait at the actor, unseen by the stage, until a
    # call ends. None: as many as ``tasks_in_flight``. Ray 2.60 hands an actor 2x its concurrency.
    concurrent_calls: int | None = None


@dataclass(frozen=True, slots=True)
class SimResult:
    makespan_s: float
    moves: int  # sequences given back at the tail and continued elsewhere
    moved_tokens: int  # tokens of KV those moves carried or recomputed
    idle_share: float  # of the actors' time from start-up to the end, the share not stepping
    rows_in_pool: int
    lease_calls: int
    steps: int
