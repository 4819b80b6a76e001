"""The one rule that decides what moves, between expert-parallel ranks and between actors.

Both callers ask the same question: which of a busy worker's sequences should go to workers with
empty running slots, and should each one's KV travel with it? The work pool asks it at the tail
of a stage for an actor (``rebalance/core/pool.py``: its load report, the stage's pooled step
model, learned output lengths); an engine's expert-parallel executor asks it for a rank, once
nothing new is being placed (``executor/expert_parallel.py``). The answer names the sequences
(``Move``: request id, whether its KV travels, to which receiver), and the giver exports exactly
those, so what is planned is what moves.

The estimates come from what the workers measured, never from sequence counts alone:

* **Remaining work of a sequence**: the tokens it has left under ``max_tokens``, lowered by the
  output lengths the job has already seen (``lengths.OutputLengths``), where the caller has them.
* **Step time**: a ``StepModel`` (``step_model.py``), ``step_s(n) = base_s + per_seq_s * n``,
  calibrated at engine start and scaled to the steps measured since; where its slope is unknown
  (no calibration, and every step observed ran one size) no running sequence is a candidate.
* **When each sequence ends** (``replay``): a worker's sequences run through its running slots in
  order (running ones first), each waiting one starting as a slot frees, every step costing
  ``step_s(sequences running)``; sequences moved in join the receiver's queue once the move is done.
* **Cost of a move** (``MigrationCosts``, measured by the giver): a fixed latency plus, per token
  of a started sequence, the cheaper of shipping its KV and recomputing it; the KV travels where
  shipping is the cheaper one.

NOTE: the rule. Candidates are the giver's queued sequences (waiting for a running slot, or for KV
memory), the last to start first, then its running ones, the most tokens left first. Receivers are
served soonest-finishing first; each takes the prefix of the candidates, at most its empty slots,
that does not delay the later finish of giver and receiver and whose gain clears the margin
(``MoveMargin``), in seconds: at least ``gain_per_cost`` times the move's estimated cost and at
least ``min_gain_steps`` of the giver's steps. The gain is measured on the work the move changes,
net of the move's cost (moved sequences start once the move is done): moving queued sequences
changes when they start, so it is how much sooner they finish, on average; moving running ones
changes the step cost on both sides, so it is how much sooner the later of giver and receiver
finishes. Among the prefixes that pass, the one with the earliest later finish wins (then the
giver's earliest finish, then the least work left on it). So queued work goes to empty slots
wherever that starts it clearly sooner, even where something else sets the finish; running work
moves only where smaller steps pay for the move several times over (a long tail on a CPU, never
its last few tokens); and nothing moves back: a prefix must strictly shorten the later finish,
and after a move no move back does. Pure Python: the coordinator's process imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchgen_data.rebalance.core.lengths import OutputLengths
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.replay import finish_s, replay
from batchgen_data.rebalance.core.step_model import StepModel


@dataclass(frozen=True, slots=True)
class MoveMargin:
    """How much a move must gain, in seconds, to be made: ``required_s``.

    ``gain_per_cost``: the estimated cost of a move (round trips, the receiver's step, shipping or
    recomputing the KV) is itself an estimate, and a move also disturbs both engines for a step
    or two; a gain of twice the cost leaves room for both. ``min_gain_steps``: an absolute floor
    in the giver's own steps (not a share of the finish, which grows with the job): a gain of
    fewer steps than this is within what the estimates miss by (a replay's rounding, tokens-left
    estimates off by a few tokens). On the demo model on a CPU, 8 steps are ~0.2 s; on an
    accelerator's ~10 ms steps, 80 ms.
    """

    gain_per_cost: float = 2.0
    min_gain_steps: float = 8.0

    def required_s(self, cost_s: float, step_s: float) -> float:
        return max(self.gain_per_cost * cost_s, self.min_gain_steps * step_s)


DEFAULT_MARGIN = MoveMargin()


@dataclass(frozen=True, slots=True)
class Move:
    request_id: int  # the giver's engine's id for the sequence
    send_kv: bool  # its KV travels (else the receiver recomputes it from the tokens)
    receiver: int  # index into the receivers ``plan_moves`` was given


@dataclass(frozen=True, slots=True)
class MovePlan:
    moves: tuple[Move, ...] = ()
    gain_s: float = 0.0  # estimated later finish of giver and receivers saved, net of the moves' cost
    before_s: float = 0.0  # that later finish without moving
    cost_s: float = 0.0  # the moves' estimated cost
    missed_s: float = 0.0  # nothing moved: the largest gain the margin refused (seconds)

    @property
    def count(self) -> int:
        return len(self.moves)

    @property
    def request_ids(self) -> list[int]:
        return [m.request_id for m in self.moves]


def plan_moves(giver: WorkerProgress, receivers: Sequence[WorkerProgress], lengths: OutputLengths | None,
               model: StepModel | None, margin: MoveMargin = DEFAULT_MARGIN) -> MovePlan:
    """Which of ``giver``'s sequences go to which of ``receivers``, by the module's rule.

    Args:
        giver (WorkerProgress): the busy worker; only its ``movable`` sequences are candidates.
        receivers (Sequence[WorkerProgress]): other workers; those without empty slots take nothing.
        lengths (OutputLengths | None): learned output lengths; None plans by ``max_tokens``.
        model (StepModel | None): step time by running sequences; None (nothing measured yet)
            plans nothing; with ``is_slope_known`` False, only queued sequences are candidates.
        margin (MoveMargin, default ``DEFAULT_MARGIN``): what a move must gain, in seconds.

    Example:
        >>> from batchgen_data.rebalance.core.progress import SeqProgress
        >>> busy = WorkerProgress(2, tuple(SeqProgress(0, 64, 20, i < 2, running=i < 2, request_id=i)
        ...                                for i in range(4)))
        >>> [m.request_id for m in plan_moves(busy, [WorkerProgress(2)], None, StepModel(0.03, 0.0)).moves]
        [3, 2]
    """
    targets = [j for j, r in enumerate(receivers) if r.free_slots > 0]
    if model is None or not targets or not any(s.movable for s in giver.seqs):
        return MovePlan()
    left = [_tokens_left(s, lengths) for s in giver.seqs]
    slots = giver.run_slots
    queued = list(range(len(left) - 1, slots - 1, -1))  # the last to start first
    running = sorted(range(min(slots, len(left))), key=lambda i: -left[i])
    if not model.is_slope_known:  # whether a smaller running set pays is not known: only queued work
        running = []
    order = [i for i in queued + running if giver.seqs[i].movable]
    work = {j: [_tokens_left(s, lengths) for s in receivers[j].seqs] for j in targets}
    giver_step_s = model.step_s(max(1, sum(1 for s in giver.seqs if s.running)))
    receiver_s = {j: finish_s(work[j], receivers[j].run_slots, model) for j in targets}
    before = max([finish_s(left, slots, model), *receiver_s.values()])

    def cost_s(ids: list[int]) -> float:
        tokens = sum(giver.seqs[i].num_tokens for i in ids if giver.seqs[i].started)
        return giver.move_latency_s + giver.move_s_per_token * tokens

    staying, moves, after, total_cost, missed = list(range(len(left))), [], dict(receiver_s), 0.0, 0.0
    for j in sorted(targets, key=receiver_s.__getitem__):
        ends = dict(zip(staying, replay([left[i] for i in staying], slots, model)))
        giver_now = max(ends.values(), default=0.0)
        baseline = best = _score(max(giver_now, receiver_s[j]), giver_now, sum(left[i] for i in staying))
        best_ids: list[int] = []
        candidates = [i for i in order if i in ends]
        for k in range(1, min(receivers[j].free_slots, len(candidates)) + 1):
            chosen = candidates[:k]
            kept = [i for i in staying if i not in chosen]
            cost = cost_s(chosen)
            landed = replay(work[j], receivers[j].run_slots, model, [left[i] for i in chosen], cost)
            if _score(max(landed))[0] > best[0]:
                break  # the receiver alone now ends later than the best so far, and more work only later
            giver_s = finish_s([left[i] for i in kept], slots, model)
            score = _score(max(giver_s, max(landed)), giver_s, sum(left[i] for i in kept))
            if score >= best:
                continue
            if any(i < slots for i in chosen):  # running work: smaller steps must pay for the move
                gain = baseline[0] - score[0]
            else:  # queued work: it must start (and so finish) clearly sooner
                gain = (sum(ends[i] for i in chosen) - sum(landed[len(work[j]):])) / len(chosen)
            if gain < margin.required_s(cost, giver_step_s):
                missed = max(missed, gain)  # it would help, but not by the margin
                continue
            best, best_ids, after[j] = score, chosen, max(landed)
        if best_ids:
            total_cost += cost_s(best_ids)
            moves += [Move(giver.seqs[i].request_id, giver.ships_kv and giver.seqs[i].started, j) for i in best_ids]
            staying = [i for i in staying if i not in best_ids]
    if not moves:
        return MovePlan(before_s=before, missed_s=missed)
    after_s = max([finish_s([left[i] for i in staying], slots, model), *after.values()])
    return MovePlan(tuple(moves), before - after_s, before, total_cost)


def _score(*seconds: float) -> tuple[float, ...]:
    """Estimates to compare, rounded to the nanosecond: a replay's float sums (a move's arrival
    splits the same steps differently) must not make equal finish times differ."""
    return tuple(round(x, 9) for x in seconds)


def _tokens_left(seq: SeqProgress, lengths: OutputLengths | None) -> float:
    if lengths is None:
        return float(seq.num_tokens_left)
    return lengths.tokens_left(seq.num_generated, seq.max_tokens)
