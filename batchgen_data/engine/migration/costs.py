"""MIGRATE between engines: what moving a sequence costs. Pure Python.

A sequence moves with its tokens and sampling state (``SequenceState``) and, optionally, its KV.
The receiving engine either restores that KV (one copy) or recomputes it (a prefill of every
token so far). Both costs grow linearly with the tokens, so the choice reduces to comparing the
KV bytes per token over the transfer rate with the time to recompute one token. Whether a move
pays at all is the move rule's question (``planner.py``), asked with these costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen_data.engine.stats import EngineStats

# KV bytes per second between two actors through Ray's object store (same node, shared memory).
# Networks between nodes are slower; callers pass their own figure.
DEFAULT_TRANSFER_BYTES_PER_S = 1e9
# Between the expert-parallel ranks of one node: a pickled copy through a local socket.
RANK_TRANSFER_BYTES_PER_S = 1e9
# Fixed cost of one move: a give-back and a lease round trip to the coordinator, and the poll
# interval of the receiving actor's lease loop.
DEFAULT_MOVE_LATENCY_S = 0.1


@dataclass(frozen=True, slots=True)
class MigrationCosts:
    kv_bytes_per_token: int
    recompute_tokens_per_s: float  # forward tokens per second of this engine: a prefill lower bound
    transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S
    latency_s: float = DEFAULT_MOVE_LATENCY_S

    @classmethod
    def of_engine(cls, engine, transfer_bytes_per_s: float | None = None, latency_s: float | None = None,
                  ) -> MigrationCosts:
        """From an ``Engine``'s counters so far."""
        return cls.of_stats(engine.stats(), engine.kv_bytes_per_token, transfer_bytes_per_s, latency_s)

    @classmethod
    def of_stats(cls, stats: EngineStats, kv_bytes_per_token: int, transfer_bytes_per_s: float | None = None,
                 latency_s: float | None = None) -> MigrationCosts:
        """From an engine's (or a rank's: the same fields) counters so far."""
        rate = stats.num_forward_tokens / stats.kernel_s if stats.kernel_s else 1e3
        return cls(kv_bytes_per_token, rate,
                   DEFAULT_TRANSFER_BYTES_PER_S if transfer_bytes_per_s is None else transfer_bytes_per_s,
                   DEFAULT_MOVE_LATENCY_S if latency_s is None else latency_s)

    def transfer_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.recompute_tokens_per_s

    def move_s_per_token(self) -> float:
        """What moving one more computed token costs: shipping its KV or recomputing it."""
        return min(self.kv_bytes_per_token / self.transfer_bytes_per_s, 1.0 / self.recompute_tokens_per_s)
