"""The seam between the ``Engine`` and where its sequences run: the ``Executor`` protocol."""

from __future__ import annotations

from typing import Protocol

from batchgen_data.engine.core.sequence import Sequence, SequenceState
from batchgen_data.engine.stats import EngineStats


class Executor(Protocol):
    """Runs the engine's sequences: schedule, forward, sample, manage KV.

    The engine calls ``add`` with validated, tokenized sequences and ``step`` until nothing is
    unfinished; ``export`` / ``import_state`` MIGRATE sequences out and in between steps.
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

    def add(self, seq: Sequence) -> None: ...

    def step(self) -> list[Sequence]:
        """One forward (every rank's, in lockstep); returns the sequences that finished in it."""

    def step_fields(self) -> dict:
        """The last step's timeline fields (``EngineConfig.collect_timeline``)."""

    def export(self, seq: Sequence, with_kv: bool = False) -> SequenceState: ...

    def import_state(self, state: SequenceState, request_id: int) -> Sequence: ...

    def stats(self) -> EngineStats:
        """The executor's counters; the request counts and ``busy_s`` are the engine's."""

    def close(self) -> None: ...
