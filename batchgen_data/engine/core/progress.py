"""What an engine publishes about its requests. Plain data, no torch: the work pool's coordinator
process imports it.

- ``RequestProgress``: one request after a step, as its executor published it (from its own
  scheduler, or an expert-parallel rank's). The engine applies it to the caller's
  ``RequestHandle``; the scheduler's ``Sequence`` record never leaves the scheduler.
  ``ProgressPublisher`` picks which records an executor publishes after a step.
- ``EngineProgress``: an engine's live requests as ``SeqProgress`` (``rebalance/core/progress.py``),
  as the rebalancer weighs moving them (``migration/engine_probe.py`` builds them from the handles
  after every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen_data.budget import tokens_left
from batchgen_data.engine.core.sequence import SequenceStatus
from batchgen_data.rebalance.core.progress import SeqProgress

if TYPE_CHECKING:
    from batchgen_data.engine.core.request import NewRequest
    from batchgen_data.engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """Where one request stands after a step. Executors publish one for every request that ran
    or changed status in the step (and one when a request is imported)."""

    request_id: int
    status: SequenceStatus
    num_generated: int
    max_tokens: int
    num_tokens: int  # prompt plus output
    num_computed_tokens: int = 0  # tokens whose KV is computed (in pages, or on host)
    has_host_kv: bool = False  # suspended with its KV kept on host: it resumes, or moves, with it

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still generate (its ``max_tokens`` budget left)."""
        return tokens_left(self.max_tokens, self.num_generated)

    @classmethod
    def of_new(cls, request: NewRequest) -> RequestProgress:
        """A request just added: waiting, nothing computed."""
        return cls(request.request_id, SequenceStatus.WAITING, 0, request.params.max_tokens,
                   len(request.prompt_token_ids))

    @classmethod
    def of(cls, seq: Sequence) -> RequestProgress:
        """A scheduler's record, read (by its executor, after a step)."""
        return cls(seq.request_id, seq.status, seq.num_generated, seq.params.max_tokens, seq.num_tokens,
                   seq.num_computed_tokens, seq.host_kv is not None)


# Statuses a record leaves the watched set (running, or compiling its grammar) with, other than
# by finishing or a MIGRATE out: suspended for memory, or its grammar compiled.
_LEFT_WATCHED = frozenset({SequenceStatus.SUSPENDED, SequenceStatus.WAITING})


class ProgressPublisher:
    """Which of a scheduler's records an executor publishes after a step, read-only.

    NOTE: a request's handle starts out WAITING and changes only through what is published, so
    after each step this publishes every running record (its tokens moved), every one compiling
    its grammar (WAITING_FOR_GRAMMAR), and those of the last step's that left those sets other
    than by finishing (suspended, or their grammar compiled); a record that stays waiting or
    suspended is not published again. O(running + compiling) per step, never O(waiting).
    """

    def __init__(self):
        self._watched: list[Sequence] = []

    def watch(self, seq: Sequence) -> None:
        """Watch a record that joined between steps (an import that got a running slot at once),
        so a status change in the next step is published."""
        self._watched.append(seq)

    def publish(self, running: list[Sequence], compiling: list[Sequence]) -> list[RequestProgress]:
        left = [seq for seq in self._watched if seq.status in _LEFT_WATCHED]
        self._watched = [*running, *compiling]
        return [RequestProgress.of(seq) for seq in left] + [RequestProgress.of(seq) for seq in self._watched]


@dataclass(frozen=True, slots=True)
class EngineProgress:
    """The engine's live sequences after a step (running ones first) and how many submissions
    it had accepted by then: what a caller needs to tell its own in-flight requests apart."""

    seqs: tuple[SeqProgress, ...] = ()
    num_accepted: int = 0
