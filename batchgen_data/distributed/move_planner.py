"""When moving running work between actors pays: measured gain against measured cost. Pure Python.

The work pool asks this module, at the tail of a stage (nothing pending), how many sequences a
busy worker should give to workers with empty running slots. The answer comes from estimates
built on what the workers measured, never from sequence counts alone:

* **Remaining work of a sequence**: the tokens it has left under ``max_tokens``, lowered by the
  output lengths the job has already seen (``OutputLengths``: rows with the same ``max_tokens``
  that finished, and generated more than this one has so far).
* **Step time**: each worker's ``StepSums`` (``engine/step_model.py``), pooled over the stage's
  workers (same model, same config) into one ``step_s(n) = base_s + per_seq_s * n``.
* **Finish time of a worker**: a replay of its sequences through its running slots
  (``finish_s``): as each one ends the next waiting one starts, and every step costs
  ``step_s(sequences running)``. While its engine has sequences suspended for want of KV
  memory, its slots are the sequences it runs now (``WorkerProgress.run_slots``).
* **Cost of a move**: a fixed latency (the give-back and lease round trips, measured by the
  giver) plus, per moved token, the cheaper of shipping its KV and recomputing it.

A move of ``k`` sequences (in the order the giver's engine would export them: unstarted first,
then the most tokens left) is planned only if it brings the later of the two finish times down
by more than ``MIN_GAIN_FRACTION`` of it: the makespan must shrink clearly, net of the move's
cost, or nothing moves. That margin is the hysteresis: after a move the two workers' finish
times are close, so no move back can gain that much, and estimation noise cannot trigger one.
Where moving cannot help (a worker's remaining time is its longest sequence's, and steps do not
get cheaper with fewer sequences), the plan is empty and rebalancing costs nothing.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from batchgen_data.engine.core.progress import SeqProgress
from batchgen_data.engine.migration.step_model import StepModel, StepSums

# A move must cut the pair's estimated finish time by at least this share (hysteresis).
MIN_GAIN_FRACTION = 0.2
# Finished rows of one max_tokens kept to learn output lengths from (the latest ones).
_LENGTH_SAMPLES = 2048
# Fewer finished rows longer than a sequence's current length than this: use the max_tokens bound.
_MIN_LENGTH_SAMPLES = 4


@dataclass(frozen=True, slots=True)
class WorkerProgress:
    """A worker's load report, sent with each lease call."""

    slots: int  # sequences its engine runs at once (max_num_seqs)
    seqs: tuple[SeqProgress, ...] = ()
    step: StepSums = field(default_factory=StepSums)
    move_s_per_token: float = 0.0  # min(KV transfer, recompute) per token, from its engine's rates
    move_latency_s: float = 0.1  # fixed cost of one move: pool round trips and the receiver's poll
    num_incoming: int = 0  # sequences leased that have not reached its engine yet

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self.seqs) - self.num_incoming)

    @property
    def run_slots(self) -> int:
        """Sequences its engine runs at once: ``slots``, or, while some are suspended for want of
        KV memory, as many as it runs now (the rest wait for memory, not for a slot)."""
        if any(s.started and not s.running for s in self.seqs):
            return max(1, sum(1 for s in self.seqs if s.running))
        return self.slots


class _LengthWindow:
    """The latest output lengths of one ``max_tokens``, with their counts and sums per length in
    Fenwick trees: the rows longer than ``n`` are counted and summed in O(log max_tokens)."""

    def __init__(self, max_tokens: int):
        self.size = max_tokens + 1  # lengths 0..max_tokens
        self.window: deque[int] = deque()
        self.sum_all = 0
        self._count = [0] * (self.size + 1)
        self._total = [0] * (self.size + 1)

    def record(self, length: int) -> None:
        length = min(max(length, 0), self.size - 1)
        self.window.append(length)
        self._add(length, 1)
        if len(self.window) > _LENGTH_SAMPLES:
            self._add(self.window.popleft(), -1)

    def _add(self, length: int, sign: int) -> None:
        self.sum_all += sign * length
        i = length + 1
        while i <= self.size:
            self._count[i] += sign
            self._total[i] += sign * length
            i += i & -i

    def longer_than(self, n: int) -> tuple[int, int]:
        """How many of the lengths exceed ``n``, and their sum."""
        count = total = 0
        i = min(max(n + 1, 0), self.size)  # the lengths 0..n
        while i > 0:
            count += self._count[i]
            total += self._total[i]
            i -= i & -i
        return len(self.window) - count, self.sum_all - total


class OutputLengths:
    """Output lengths of the job's finished rows, by ``max_tokens``; estimates tokens left."""

    def __init__(self):
        self._by_max: dict[int, _LengthWindow] = {}

    def record(self, max_tokens: int, num_generated: int) -> None:
        window = self._by_max.get(int(max_tokens))
        if window is None:
            window = self._by_max[int(max_tokens)] = _LengthWindow(int(max_tokens))
        window.record(int(num_generated))

    def tokens_left(self, num_generated: int, max_tokens: int) -> float:
        """Expected tokens still to come: the mean remaining length of finished rows (same
        ``max_tokens``) that outlived ``num_generated``; the ``max_tokens`` bound while fewer than
        a handful did (a sequence longer than all its finished peers may run to its limit)."""
        bound = max(0, max_tokens - num_generated)
        window = self._by_max.get(int(max_tokens))
        if window is None:
            return float(bound)
        count, total = window.longer_than(num_generated)
        if count < _MIN_LENGTH_SAMPLES:
            return float(bound)
        return min(float(bound), total / count - num_generated)


def finish_s(tokens_left: list[float], slots: int, model: StepModel) -> float:
    """Seconds until a worker finishes ``tokens_left`` (its running sequences first, in order)
    through ``slots`` running slots, one token per sequence per step."""
    if not tokens_left or slots <= 0:
        return 0.0
    ends = [max(1.0, t) for t in tokens_left[:slots]]  # step at which each running one ends
    heapq.heapify(ends)
    queue = deque(max(1.0, t) for t in tokens_left[slots:])
    now = seconds = 0.0
    while ends:
        first = ends[0]
        seconds += (first - now) * model.step_s(len(ends))
        now = first
        while ends and ends[0] <= now:
            heapq.heappop(ends)
            if queue:
                heapq.heappush(ends, now + queue.popleft())
    return seconds


@dataclass(frozen=True, slots=True)
class MovePlan:
    count: int = 0  # sequences the giver should export (its engine's export order)
    gain_s: float = 0.0  # estimated makespan saved, net of the moves' cost
    before_s: float = 0.0  # estimated finish of the later of giver and receivers, without moving
    cost_s: float = 0.0  # the moves' estimated cost


def plan_moves(giver: WorkerProgress, receivers: list[WorkerProgress], lengths: OutputLengths,
               model: StepModel | None, min_gain_fraction: float = MIN_GAIN_FRACTION) -> MovePlan:
    """How many of ``giver``'s sequences to hand to ``receivers`` (workers with empty slots).

    Receivers are taken soonest-finishing first; each gets the count (at most its empty slots)
    that brings its and the giver's later finish time down the most (or, leaving it as it is,
    the giver's work). The plan stands only if the later finish of all of them drops by
    ``min_gain_fraction`` of what it was.
    """
    receivers = [r for r in receivers if r.free_slots > 0]
    if model is None or not giver.seqs or not receivers:
        return MovePlan()
    left = [lengths.tokens_left(s.num_generated, s.max_tokens) for s in giver.seqs]
    work = [[lengths.tokens_left(s.num_generated, s.max_tokens) for s in r.seqs] for r in receivers]
    # The engine's export order (``pick_to_move``): unstarted first, then the most tokens left.
    order = sorted((i for i, s in enumerate(giver.seqs) if s.movable), key=lambda i: (giver.seqs[i].started, -left[i]))
    staying = list(range(len(left)))  # in the giver's order: running ones first

    def giver_s(ids) -> float:
        return finish_s([left[i] for i in ids], giver.run_slots, model)

    def cost_s(ids) -> float:
        tokens = sum(giver.seqs[i].num_tokens for i in ids if giver.seqs[i].started)
        return giver.move_latency_s + giver.move_s_per_token * tokens if ids else 0.0

    receiver_s = [finish_s(w, r.run_slots, model) for r, w in zip(receivers, work)]
    before = max([giver_s(staying)] + receiver_s)
    after_receivers, total_cost = list(receiver_s), 0.0
    for j in sorted(range(len(receivers)), key=receiver_s.__getitem__):
        candidates = [i for i in order if i in staying]
        # Best: the pair's later finish; among equals, the least work left with the giver (so
        # that receivers with a few slots each can, together, take a whole wave off it).
        best_k, best = 0, (max(giver_s(staying), receiver_s[j]), sum(left[i] for i in staying))
        for k in range(1, min(receivers[j].free_slots, len(candidates)) + 1):
            chosen = candidates[:k]
            kept = [i for i in staying if i not in chosen]
            landed = cost_s(chosen) + finish_s(work[j] + [left[i] for i in chosen], receivers[j].run_slots, model)
            score = (max(giver_s(kept), landed), sum(left[i] for i in kept))
            if score < best:
                best_k, best, after_receivers[j] = k, score, landed
        if best_k:
            total_cost += cost_s(candidates[:best_k])
            staying = [i for i in staying if i not in candidates[:best_k]]
    count = len(left) - len(staying)
    gain = before - max([giver_s(staying)] + after_receivers)
    if count == 0 or gain < min_gain_fraction * before:  # declined: the estimates, for the record (0 if no move helped)
        return MovePlan(0, gain, before, total_cost)
    return MovePlan(count, gain, before, total_cost)
