"""``EngineProbe``: what rebalancing reads about one ``AsyncEngine``, taken on its engine thread.

A step listener (``AsyncEngine.add_step_listener``). NOTE: after every loop turn of the engine
thread it publishes one ``ProbeSnapshot`` by one attribute assignment: the live requests (a tuple
of their entries, taken then) with the count of submissions accepted by then, a copy of its
``StepSums`` (how step time grows with the running set: the engine's calibrated line, if
``calibrate`` was given one, and every decode step observed since), and what moving one computed
token costs (``MigrationCosts``, refreshed every ``COSTS_EVERY_STEPS`` steps). That is O(1) work
per step beyond the tuple copy, so publishing after every step costs nothing measurable (~10 us
at 256 live requests, against ~0.4 ms when it built every request's ``SeqProgress`` per step).
The reader builds the ``EngineProgress`` (``snapshot.progress``) when it asks, from each request's
``RequestProgress``, which the engine replaces whole: the set of requests and the accepted count
are one step's, and a request that finished since reads as gone (its slot is free). The snapshot
is frozen and its sums are a copy no one writes again, so a reader on another thread (the
rebalancer's lease loop) always sees one consistent step, never a half-updated one.
Torch-free apart from the engine it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from batchgen_data.engine.core.progress import EngineProgress
from batchgen_data.engine.core.sequence import EXPORTABLE, SequenceStatus
from batchgen_data.engine.migration.costs import MigrationCosts
from batchgen_data.rebalance.core.progress import SeqProgress
from batchgen_data.rebalance.core.step_model import StepModel, StepSums

if TYPE_CHECKING:
    from batchgen_data.engine.async_engine import AsyncEngine, LiveRequest
    from batchgen_data.engine.step_report import StepReport

# Steps between two refreshes of the move cost (it changes slowly: the engine's mean rates).
COSTS_EVERY_STEPS = 32


@dataclass(frozen=True, slots=True)
class ProbeSnapshot:
    """One engine-thread view of an engine, replaced whole after every loop turn."""

    live: tuple[LiveRequest, ...] = ()  # the live requests then
    num_accepted: int = 0  # submissions accepted by then
    step: StepSums = field(default_factory=StepSums)  # a copy: never written after publication
    move_s_per_token: float = 0.0

    @property
    def progress(self) -> EngineProgress:
        """The live requests as ``SeqProgress`` (running first, then suspended, then waiting: the
        order they would run in), built now; one that finished since is left out."""
        seqs = []
        for entry in self.live:
            progress = entry.handle.progress  # replaced whole by the engine: one consistent record
            if progress.status in EXPORTABLE:
                started = progress.status in (SequenceStatus.RUNNING, SequenceStatus.SUSPENDED)
                seqs.append(SeqProgress(progress.num_generated, progress.max_tokens, progress.num_tokens, started,
                                        entry.movable, progress.status is SequenceStatus.RUNNING,
                                        progress.request_id, entry.in_pool))
        return EngineProgress(tuple(sorted(seqs, key=lambda p: (not p.running, not p.started))), self.num_accepted)


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

    def calibrate(self, model: StepModel) -> None:
        """Publish ``model`` (``calibration.calibrate_engine``) as this engine's calibrated line
        from the next snapshot on. Call it before the engine thread starts."""
        self._sums.calibrate(model)
        self.snapshot = replace(self.snapshot, step=replace(self._sums))

    def __call__(self, engine: AsyncEngine, report: StepReport | None, live: Mapping[int, LiveRequest]) -> None:
        if report is not None:
            self._sums.observe(report.num_running, report.num_tokens, report.step_s)
            self._steps_since_costs += 1
        if self._steps_since_costs >= COSTS_EVERY_STEPS:
            self._steps_since_costs = 0
            self._move_s_per_token = MigrationCosts.of_engine(engine.engine).move_s_per_token()
        self.snapshot = ProbeSnapshot(tuple(live.values()), engine.num_accepted, replace(self._sums),
                                      self._move_s_per_token)
