"""Which of a batch's rows start on the actor's own engine while the stage runs without a pool:
those that fit its free running slots and KV memory now, the longest first. The rest would
queue there, so they go to the stage's pool (``rebalance.client.RebalanceClient.run_batch``), started
on demand: a stage whose rows never queue runs no coordinator at all.

Measured on the skew grid (issue #33, 2 cores): a coordinator started as the actors load delayed
their first step by 0.4-0.6 s (its process among theirs), 4-6% of a 10 s job where nothing could
be gained by moving rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineRoom:
    """What an engine has free now for rows that should start at once."""

    slots: int  # running slots no sequence holds or waits for
    kv_tokens: int  # KV tokens the sequences it holds will not need, at their full lengths


def full_length(prompt: Any, max_tokens: int) -> int:
    """A row's KV tokens at its end, estimated before tokenizing: its prompt at ~4 characters a
    token (messages as their text), plus its ``max_tokens``."""
    return len(str(prompt)) // 4 + 1 + max_tokens


def rows_here(lengths: list[int], room: EngineRoom) -> list[int]:
    """Indices (ascending) of the rows, by their full ``lengths``, that start on this engine now:
    the longest first while they fit its free slots and KV; the others would wait there.

    Example:
        >>> rows_here([300, 20, 300, 20], EngineRoom(slots=3, kv_tokens=640))
        [0, 1, 2]
        >>> rows_here([300, 20, 300, 20], EngineRoom(slots=8, kv_tokens=340))
        [0, 1, 3]
    """
    chosen, kv = [], room.kv_tokens
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if len(chosen) == room.slots:
            break
        if lengths[i] <= kv:
            chosen.append(i)
            kv -= lengths[i]
    return sorted(chosen)
