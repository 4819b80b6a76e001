"""MIGRATE between engines: what moving a sequence costs, and which sequences are worth moving.

A sequence moves with its tokens and sampling state (``SequenceState``) and, optionally, its KV.
The receiving engine either restores that KV (one copy) or recomputes it (a prefill of every
token so far). Both costs grow linearly with the tokens, so the choice reduces to comparing the
KV bytes per token over the transfer rate with the time to recompute one token.

A move pays only if the time it saves exceeds what it costs: the sequence must still have many
tokens to decode, and the giving engine's steps must be slow enough for splitting its running
set to matter. ``worth_moving`` keeps the estimate conservative: it moves a sequence when the
move costs less than half the decode time the sequence has left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchgen_data.engine.core.sequence import Sequence, SequenceStatus
from batchgen_data.engine.stats import EngineStats

# KV bytes per second between two actors through Ray's object store (same node, shared memory).
# Networks between nodes are slower; callers pass their own figure.
DEFAULT_TRANSFER_BYTES_PER_S = 1e9
# Fixed cost of one move: a give-back and a lease round trip to the coordinator, and the poll
# interval of the receiving actor's lease loop.
DEFAULT_MOVE_LATENCY_S = 0.1


class MovePolicy(Protocol):
    """Which sequences are worth moving to another engine, and whether their KV travels
    (``MigrationCosts`` is the one the project uses)."""

    def worth_moving(self, seq: Sequence) -> bool: ...

    def send_kv(self, num_tokens: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class MigrationCosts:
    kv_bytes_per_token: int
    recompute_tokens_per_s: float  # forward tokens per second of this engine: a prefill lower bound
    step_s: float  # mean decode step of this engine (what one more token of a sequence costs)
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
        rate = stats.num_forward_tokens / stats.kernel_s if stats.kernel_s else 1e3
        step = stats.busy_s / stats.num_forwards if stats.num_forwards else 0.0
        return cls(kv_bytes_per_token, rate, step,
                   DEFAULT_TRANSFER_BYTES_PER_S if transfer_bytes_per_s is None else transfer_bytes_per_s,
                   DEFAULT_MOVE_LATENCY_S if latency_s is None else latency_s)

    def send_kv(self, num_tokens: int) -> bool:
        """Ship the KV (True) or let the receiver recompute it (False)."""
        return num_tokens > 0 and self.transfer_s(num_tokens) < self.recompute_s(num_tokens)

    def transfer_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.recompute_tokens_per_s

    def move_s(self, seq: Sequence) -> float:
        tokens = seq.num_computed_tokens
        return self.latency_s + min(self.transfer_s(tokens), self.recompute_s(seq.num_tokens))

    def move_s_per_token(self) -> float:
        """What moving one more computed token costs: shipping its KV or recomputing it."""
        return min(self.kv_bytes_per_token / self.transfer_bytes_per_s, 1.0 / self.recompute_tokens_per_s)

    def worth_moving(self, seq: Sequence) -> bool:
        return self.move_s(seq) < 0.5 * seq.num_tokens_left * self.step_s


def pick_to_move(candidates: list[Sequence], max_count: int, policy: MovePolicy) -> list[Sequence]:
    """Up to ``max_count`` of ``candidates`` to MIGRATE out: unstarted ones first (nothing to
    move but tokens), then running or suspended ones with the most tokens left among those the
    policy finds worth moving. Used across actors and across expert-parallel ranks alike."""
    if max_count <= 0:
        return []
    unstarted = [s for s in candidates if s.status is SequenceStatus.WAITING]
    started = sorted((s for s in candidates if s.status in (SequenceStatus.RUNNING, SequenceStatus.SUSPENDED)),
                     key=lambda s: -s.num_tokens_left)
    chosen = unstarted[:max_count]
    for seq in started:
        if len(chosen) == max_count:
            break
        if policy.worth_moving(seq):
            chosen.append(seq)
    return chosen
