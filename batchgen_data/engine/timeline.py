"""The per-step timeline (``EngineConfig.collect_timeline``): one record per engine step."""

from __future__ import annotations

from collections.abc import Callable


class StepTimeline:
    """Records ``{"t", "step_s", **executor fields}`` per step, ``t`` in seconds since the
    engine started; ``entries`` is the list plots and benchmarks read (``Engine.timeline``)."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.entries: list[dict] = []

    def record(self, step_s: float, fields: dict) -> None:
        self.entries.append({"t": self._clock(), "step_s": step_s, **fields})
