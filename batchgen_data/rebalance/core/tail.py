"""PARTITION at the tail (``plan_give_back``): which of a busy worker's sequences the pool asks it
to give back, by the move rule over every alive worker's report carried forward to now. Pure
Python, over the ``WorkPool``'s state (``pool.py``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from batchgen_data.rebalance.core.compute import joining
from batchgen_data.rebalance.core.leasing import busy_workers, compute_shares
from batchgen_data.rebalance.core.move_rule import Move, plan_moves
from batchgen_data.rebalance.core.pool_state import Load, leased_since, pooled_step_model
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.work_item import WorkItem

if TYPE_CHECKING:
    from batchgen_data.rebalance.core.pool import WorkPool

# After giving sequences back, a worker is not asked again for this long (the receivers'
# load reports must catch up first, or the pool would over-give): with the planner's gain
# margin, the time half of the hysteresis.
PARTITION_COOLDOWN_S = 1.0
# A tail plan weighs at most this many receivers, or twice the sequences it could move if more.
_MIN_RECEIVERS = 8


def _unreported(item: WorkItem, tokens_left: float) -> SeqProgress:
    """An item leased to a worker after its last report, as the waiting sequence it is about to
    be there (not movable: its engine has no id for it yet)."""
    return SeqProgress(item.num_generated, item.num_generated + max(1, round(tokens_left)), item.num_generated,
                       started=False, movable=False, running=False)


def plan_give_back(pool: WorkPool, worker: str, now: float) -> list[Move]:
    """PARTITION at the tail: which of its sequences ``worker`` should give back.

    Only once nothing is pending (idle actors take unstarted work first), not within the
    cooldown after its last give-back, and only those ``plan_moves`` names: the alive
    workers' reports, each carried forward to ``now`` by the stage's step model
    (``WorkerProgress.advanced``: a worker whose call is held reported when it called),
    receivers being those that take work now (``Members.takes_work``) with empty slots; the stage's pooled step model (calibrated lines
    at the measured level); and the learned output lengths must show the moves paying for
    themselves (``move_rule.py``). The worker exports exactly these, so
    ``num_moves_planned`` counts sequences that are given back.
    """
    me = pool.loads.get(worker)
    if pool.pending or me is None or now - pool.last_gave.get(worker, -1e9) < PARTITION_COOLDOWN_S:
        return []
    movable = sum(1 for s in me.progress.seqs if s.movable)
    if not movable:
        return []  # nothing it could give (most calls at the tail: idle receivers)
    alive = {w: load for w, load in pool.loads.items() if w == worker or pool.is_alive(w, now)}
    model = pooled_step_model(pool.step_total, pool.loads, alive)
    incoming = _moving_to(pool, now)
    busy = busy_workers(pool) | {worker}
    takers = sorted(w for w, load in alive.items()
                    if w != worker and load.progress.free_slots > 0 and pool.membership.takes_work(w, now))
    joined = joining(takers, compute_shares(pool, now), busy)  # an idle one only where it adds compute
    # The least loaded of them (by their last reports' tokens left, and what is moving to them):
    # the rule serves the soonest-finishing receivers first, and each takes at most its free
    # slots, so a few more than the sequences it could move are enough (and keep a plan's cost
    # independent of the stage's size).
    names = sorted((w for w in takers if w in busy or w in joined),
                   key=lambda w: _load_tokens(alive[w], incoming.get(w, ())))[:max(_MIN_RECEIVERS, 2 * movable)]
    reports = {w: _report_now(pool, w, alive[w], now, model, incoming.get(w, ())) for w in [worker, *names]}
    names = [w for w in names if reports[w].free_slots > 0]
    receivers = [reports[w] for w in names]
    if not receivers or not any(s.movable for s in reports[worker].seqs):
        return []
    plan = plan_moves(reports[worker], receivers, pool.lengths, model)
    pool.planned_moves[worker] = {m.request_id: names[m.receiver] for m in plan.moves}
    pool.counters.num_moves_planned += plan.count
    if not plan.count and plan.missed_s > 0:
        pool.counters.num_moves_declined += 1
    return list(plan.moves)


def _load_tokens(load: Load, incoming) -> float:
    """A worker's outstanding tokens by its last report, and those moving to it."""
    if load.tokens_left is None:
        load.tokens_left = sum(s.num_tokens_left for s in load.progress.seqs)
    return load.tokens_left + sum(item.max_tokens - item.num_generated for item in incoming)


def _moving_to(pool: WorkPool, now: float) -> dict[str, list[WorkItem]]:
    """Sequences given back and not leased yet, by the receivers their moves were planned for
    (while they are kept for them): work on its way there, which another giver's plan must see,
    or every giver would send its stragglers to the same idle worker."""
    incoming: dict[str, list[WorkItem]] = {}
    for item_id in pool.pending:
        item = pool.items[item_id]
        if item.meant_for is not None and now < item.not_for_until:
            incoming.setdefault(item.meant_for, []).append(item)
    return incoming


def _report_now(pool: WorkPool, worker: str, load: Load, now: float, model, incoming=()) -> WorkerProgress:
    """A worker's last report carried forward to ``now``, with the items leased to it since
    (not in its engine when it reported; the ones it finished since are gone) and the sequences
    moving to it (``incoming``)."""
    report = load.progress.advanced(now - load.seen, model)
    unreported = leased_since(load, pool.leases, worker) + list(incoming)
    if not unreported:
        return report
    extra = tuple(_unreported(item, pool.cost(item) - 1) for item in unreported)
    return replace(report, seqs=report.seqs + extra)
