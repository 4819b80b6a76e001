"""The per-step timeline (``EngineConfig.collect_timeline``): one record per engine step."""

from __future__ import annotations

from collections.abc import Callable

from batchgen_data.engine.step_report import StepReport


class StepTimeline:
    """Records ``{"t", "step_s", "num_running", "num_waiting", "num_tokens", "num_sampled",
    **extras}`` per step (a ``StepReport``; ``num_waiting`` is its ``num_queued``), ``t`` in
    seconds since the engine started; ``entries`` is the list plots and benchmarks read
    (``Engine.timeline``)."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.entries: list[dict] = []

    def record(self, report: StepReport) -> None:
        self.entries.append({
            "t": self._clock(),
            "step_s": report.step_s,
            "num_running": report.num_running,
            "num_waiting": report.num_queued,
            "num_tokens": report.num_tokens,
            "num_sampled": report.num_sampled,
            **report.extras,
        })
