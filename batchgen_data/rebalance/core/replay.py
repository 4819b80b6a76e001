"""When each of a worker's sequences ends, by the step model: a worker's sequences run through its
running slots in order (running ones first), each waiting one starting as a slot frees, every
step costing ``step_s(sequences running)``; sequences moved in join the queue once the move is
done. The move rule (``move_rule.py``) and the simulator's modelled actors estimate with it.
Pure Python."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from batchgen_data.rebalance.core.step_model import StepModel


def replay(tokens_left: Sequence[float], slots: int, model: StepModel, arriving: Sequence[float] = (),
           arrive_s: float = 0.0) -> list[float]:
    """Seconds until each sequence ends: ``tokens_left`` in order through ``slots`` running slots
    (the first ones run now, each next one starts as a slot frees), one token per running sequence
    per step, each step costing ``model.step_s(running)``; ``arriving`` join the queue after
    ``arrive_s`` seconds. End times of ``tokens_left``, then of ``arriving``."""
    work = [max(1.0, t) for t in (*tokens_left, *arriving)]
    ends_s = [0.0] * len(work)
    if slots <= 0:
        return ends_s
    queue = deque(range(len(tokens_left)))
    late = list(range(len(tokens_left), len(work)))
    running: list[tuple[float, int]] = []  # (step count at which it ends, index)
    step = seconds = 0.0

    def start_waiting() -> None:
        while queue and len(running) < slots:
            i = queue.popleft()
            heapq.heappush(running, (step + work[i], i))

    start_waiting()
    while running or queue or late:
        step_s = model.step_s(len(running))
        if late and (not running or seconds + (running[0][0] - step) * step_s > arrive_s):
            if running:  # the running ones get this far before the moved ones arrive
                step += (arrive_s - seconds) / step_s
            seconds = max(seconds, arrive_s)
            queue.extend(late)
            late = []
            start_waiting()
            continue
        end = running[0][0]
        seconds += (end - step) * step_s
        step = end
        while running and running[0][0] <= step:
            ends_s[heapq.heappop(running)[1]] = seconds
        start_waiting()
    return ends_s


def finish_s(tokens_left: Sequence[float], slots: int, model: StepModel) -> float:
    """Seconds until a worker finishes ``tokens_left`` (its running sequences first, in order)."""
    return max(replay(tokens_left, slots, model), default=0.0)
