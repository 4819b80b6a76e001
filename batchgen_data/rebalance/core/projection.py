"""What a worker's running-set size does to its longest row and to the stage's end: the cap that
lets a row end in time (``running_cap``), and the earliest end of a stage whose workers run at
those caps (``stage_end_s``). Pure Python, arithmetic over a ``StepModel``; ``pacing.py`` uses it."""

from __future__ import annotations

import math
from collections.abc import Iterable

from batchgen_data.rebalance.core.step_model import StepModel

_BISECT_STEPS = 40


def running_cap(tokens_left: float, time_left_s: float, model: StepModel, slots: int) -> int:
    """The most sequences a worker may run for one with ``tokens_left`` to end in ``time_left_s``
    (at least one; ``slots`` where the slope is unknown).

    Example:
        >>> running_cap(1000, 20.0, StepModel(0.01, 0.001), 64)  # 20 ms a step: 10 running
        10
        >>> running_cap(10, 20.0, StepModel(0.01, 0.001), 64)
        64
    """
    if tokens_left <= 0 or not model.is_slope_known or model.per_seq_s <= 0:
        return slots
    per_step_s = time_left_s / tokens_left
    if per_step_s >= model.step_s(slots):
        return slots
    return max(1, min(slots, math.floor((per_step_s - model.base_s) / model.per_seq_s + 1e-9)))


def stage_end_s(longest: Iterable[tuple[float, int]], work_tokens: float, model: StepModel,
                max_paced: int | None = None) -> float:
    """Seconds from now until the stage can end: the least ``D`` such that the workers, given as
    (tokens left of the longest sequence each holds, its slots), the ``max_paced`` with the
    longest each running ``running_cap`` of it for ``D`` and the others full sets, make
    ``work_tokens`` tokens in ``D``, and their paced longest ones end.

    Example:
        >>> m = StepModel(0.01, 0.001)
        >>> round(stage_end_s([(0, 10), (0, 10)], 4000, m), 3)  # 2 x 10 / 20 ms = 1000 tok/s
        4.0
    """
    workers = sorted(longest, reverse=True)
    if not workers or work_tokens <= 0:
        return 0.0
    paced = len(workers) if max_paced is None else max_paced

    def made(d: float) -> float:
        caps = [running_cap(left, d, model, slots) if k < paced else slots for k, (left, slots) in enumerate(workers)]
        return d * sum(n / model.step_s(n) for n in caps)

    lo = max(left * model.step_s(1) for left, _ in workers[:max(1, paced)])
    hi = max(lo, max(left * model.step_s(slots) for left, slots in workers),
             work_tokens / sum(slots / model.step_s(slots) for _, slots in workers))
    if made(lo) >= work_tokens:
        return lo
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if made(mid) >= work_tokens:
            hi = mid
        else:
            lo = mid
    return hi
