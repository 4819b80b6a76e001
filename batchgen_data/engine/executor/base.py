"""The seam between the ``Engine`` and where its requests run: the ``Executor`` protocol and what
one executor step returns (``ExecutorStep``).

NOTE: requests cross the seam as plain records, never as the scheduler's ``Sequence``: in
through ``add`` (a ``NewRequest``), out as ``FinishedRequest``s, and in between as the
``RequestProgress`` an executor publishes after each step for the requests that ran or changed
status (from its scheduler, or from every rank's). MIGRATE works by request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchgen_data.engine.core.progress import RequestProgress
from batchgen_data.engine.core.request import FinishedRequest, NewRequest
from batchgen_data.engine.core.sequence import SequenceState
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.step_report import StepReport


@dataclass(slots=True)
class ExecutorStep:
    """What one step published: progress of the requests that ran or changed status (a request
    may appear once), those that finished, and the step's counts (``step_s`` left to the engine)."""

    progress: list[RequestProgress]
    finished: list[FinishedRequest]
    report: StepReport


class Executor(Protocol):
    """Runs the engine's requests: schedule, forward, sample, manage KV.

    The engine calls ``add`` with validated, tokenized requests and ``step`` until nothing is
    unfinished; ``export`` / ``import_state`` MIGRATE requests out and in between steps.
    """

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks one sequence can use at most (one rank's pool under expert parallelism)."""

    @property
    def block_size(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's KV costs, all layers (``KVSpec``s): what a MIGRATE ships."""

    @property
    def max_running_seqs(self) -> int:
        """Sequences run at once (every rank's running set; the planned one when experts stream)."""

    @property
    def num_unfinished(self) -> int: ...

    def add(self, request: NewRequest) -> None: ...

    def step(self) -> ExecutorStep:
        """One forward (every rank's, in lockstep)."""

    def export(self, request_id: int, with_kv: bool = False) -> SequenceState:
        """MIGRATE out a waiting, suspended or running request (between steps)."""

    def import_state(self, state: SequenceState, request_id: int) -> RequestProgress:
        """MIGRATE in ``state`` as request ``request_id``; its progress as of now."""

    def stats(self) -> EngineStats:
        """The executor's counters; the request counts and ``busy_s`` are the engine's."""

    def close(self) -> None: ...
