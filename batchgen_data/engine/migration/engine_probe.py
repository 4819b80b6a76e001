"""``EngineProbe``: what rebalancing reads about one ``AsyncEngine``, taken on its engine thread.

A step listener (``AsyncEngine.add_step_listener``). NOTE: after every loop turn of the engine
thread it builds one ``ProbeSnapshot`` — the live requests as ``SeqProgress`` (running ones
first, then suspended, then waiting: the order they would run in) with the count of submissions
accepted by then, a copy of its ``StepSums`` (how step time grows with the running set, observed
over every step), and what moving one computed token costs (``MigrationCosts``, refreshed every
``COSTS_EVERY_STEPS`` steps) — and publishes it by one attribute assignment. The snapshot is
frozen and its sums are a copy no one writes again, so a reader on another thread (the
rebalancer's lease loop) always sees one consistent step, never a half-updated one.
Torch-free apart from the engine it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from batchgen_data.engine.core.progress import EngineProgress, SeqProgress
from batchgen_data.engine.core.sequence import EXPORTABLE, SequenceStatus
from batchgen_data.engine.migration.costs import MigrationCosts
from batchgen_data.engine.migration.step_model import StepSums

if TYPE_CHECKING:
    from batchgen_data.engine.async_engine import AsyncEngine, LiveRequest
    from batchgen_data.engine.step_report import StepReport

# Steps between two refreshes of the move cost (it changes slowly: the engine's mean rates).
COSTS_EVERY_STEPS = 32


@dataclass(frozen=True, slots=True)
class ProbeSnapshot:
    """One engine-thread view of an engine, replaced whole after every loop turn."""

    progress: EngineProgress = field(default_factory=EngineProgress)
    step: StepSums = field(default_factory=StepSums)  # a copy: never written after publication
    move_s_per_token: float = 0.0


class EngineProbe:
    """Publishes ``snapshot`` (a ``ProbeSnapshot``) after every loop turn of an engine thread.

    Example:
        >>> from batchgen_data import Engine
        >>> from batchgen_data.engine.async_engine import AsyncEngine
        >>> aengine = AsyncEngine(Engine("demo"))
        >>> probe = EngineProbe.attach(aengine)
        >>> probe.snapshot.progress.num_accepted
        0
        >>> aengine.shutdown()
    """

    def __init__(self):
        self.snapshot = ProbeSnapshot()
        self._sums = StepSums()  # the engine thread's own; published only as copies
        self._move_s_per_token = 0.0
        self._steps_since_costs = COSTS_EVERY_STEPS  # the first turn measures the costs

    @classmethod
    def attach(cls, engine: AsyncEngine) -> EngineProbe:
        probe = cls()
        engine.add_step_listener(probe)
        return probe

    def __call__(self, engine: AsyncEngine, report: StepReport | None, live: Mapping[int, LiveRequest]) -> None:
        if report is not None:
            self._sums.observe(report.num_running, report.num_tokens, report.step_s)
            self._steps_since_costs += 1
        seqs = [SeqProgress(handle.num_generated, handle.params.max_tokens, handle.num_tokens,
                            handle.status in (SequenceStatus.RUNNING, SequenceStatus.SUSPENDED), entry.movable,
                            handle.status is SequenceStatus.RUNNING, handle.request_id)
                for entry in live.values() if (handle := entry.handle).status in EXPORTABLE]
        progress = EngineProgress(tuple(sorted(seqs, key=lambda p: (not p.running, not p.started))),
                                  engine.num_accepted)
        if self._steps_since_costs >= COSTS_EVERY_STEPS:
            self._steps_since_costs = 0
            self._move_s_per_token = MigrationCosts.of_engine(engine.engine).move_s_per_token()
        self.snapshot = ProbeSnapshot(progress, replace(self._sums), self._move_s_per_token)
