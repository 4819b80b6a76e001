"""Where an engine's sequences stand, as the rebalancer weighs moving them. Plain data, no torch:
the work pool's coordinator process imports it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqProgress:
    """One live sequence of an engine."""

    num_generated: int
    max_tokens: int
    num_tokens: int  # prompt plus output: the KV a move ships or the receiver recomputes
    started: bool  # running or suspended (False: waiting, nothing computed yet)
    movable: bool = True
    running: bool = True  # in the running set now (False: waiting, or suspended for KV memory)


@dataclass(frozen=True, slots=True)
class EngineProgress:
    """The engine's live sequences after a step (running ones first) and how many submissions
    it had accepted by then: what a caller needs to tell its own in-flight requests apart."""

    seqs: tuple[SeqProgress, ...] = ()
    num_accepted: int = 0
