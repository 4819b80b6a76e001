"""Which pending items a worker leases (``lease``): the longest first, its fair share of the
outstanding work over the stage's members, other owners' items only where they would queue. Pure
Python, over the ``WorkPool``'s state (``pool.py``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from batchgen_data.rebalance.core import pacing
from batchgen_data.rebalance.core.compute import joining
from batchgen_data.rebalance.core.members import Spread
from batchgen_data.rebalance.core.pool_state import Lease, Load, leased_since
from batchgen_data.rebalance.core.progress import WorkerProgress
from batchgen_data.rebalance.core.work_item import WorkItem

if TYPE_CHECKING:
    from batchgen_data.rebalance.core.pool import WorkPool

# Cache affinity: each worker remembers the prefix keys (``work_item.prefix_key``) of the items
# it leased most recently, as a stand-in for the prefixes its engine's cache holds.
_PREFIXES_PER_WORKER = 64


def lease(pool: WorkPool, worker: str, max_items: int, now: float, progress: WorkerProgress | None = None,
          ) -> list[WorkItem]:
    """Up to ``max_items`` pending items, the longest first; among equals, those whose
    prompt prefix the worker ran lately (its engine likely holds that prefix's KV: cache
    affinity), then the worker's own.

    Its own items it takes up to ``max_items`` (its free running slots: they would start
    nowhere sooner). Another owner's only where that owner has no room for them now
    (``_reserved_for_owners``): work moves where it would queue, not where it would run
    anyway. Of those, a worker holds at most its fair share of the outstanding work (pending
    plus leased, in estimated tokens, and the rows actors run outside the pool as their
    reports give them, over the stage's ``members``), so nobody hoards long
    rows another actor would start now; and while some member has not leased yet, they go
    round-robin, longest first (``members.Spread``). A worker holding nothing always gets
    one item. Once the stage's input is all in, a worker holding a row long for the job takes
    no more than that row's pace allows, and long items go to the workers paced for them
    (``pacing.py``).
    ``progress`` (its engine's sequences, step times and move cost) is its load report for
    ``plan_give_back``.
    """
    pool.expire(now)
    pool.last_heard[worker] = now
    if progress is not None:
        pool.set_load(worker, Load(progress, now))
        pool.num_reports += 1
    members = pool.members(now) | {worker}
    if not pool.membership.last_seen:
        pool.counters.num_members_at_first_lease = len(members)
    # Only those that would add compute share the rows that queue (``compute.joining``).
    busy, shares = busy_workers(pool), compute_shares(pool, now)
    members &= busy | joining([worker, *sorted(members - {worker})], shares, busy)
    joins = worker in members
    num_turns = pool.membership.num_turns(worker, members | {worker})
    pool.membership.saw_lease(worker, now)
    taken: list[WorkItem] = []
    if max_items <= 0 or not pool.pending or pacing.at_pace(pool, worker, now):
        return taken
    # Longest first (by estimated tokens left), the worker's own items first among equals:
    # long rows start early and overlap with short ones instead of forming the job's tail
    # (longest-processing-time-first, the classic makespan rule for parallel machines).
    items, tokens_left = pool.items, pool.lengths.tokens_left  # ``pool.cost``, inlined: every lease asks it of every item
    cost = {i: tokens_left(items[i].num_generated, items[i].max_tokens) + 1 for i in (*pool.pending, *pool.leases)}
    reserved = _reserved_for_owners(pool, worker, cost, now)
    leasable = [i for i in pool.pending if not kept_from(pool.items[i], worker, now) and i not in reserved
                and (joins or free_for(pool.items[i], worker))]
    mine = pool.prefixes.setdefault(worker, OrderedDict())
    leasable.sort(key=lambda i: (-cost[i], pool.items[i].prefix not in mine,
                                 pool.items[i].owner != worker))
    # Work held outside the pool counts too: rows actors started on their own engines.
    local = {w: load.progress.local_tokens for w, load in pool.loads.items() if pool.is_alive(w, now)}
    held = sum(cost[i] for i, lease in pool.leases.items() if lease.worker == worker) + local.get(worker, 0)
    outstanding = sum(cost.values()) + sum(local.values())
    quota = -(-outstanding // max(1, len(members))) - held
    if quota <= 0 and held > 0 and not any(free_for(pool.items[i], worker) for i in leasable):
        return taken  # over its share already; a worker holding nothing always gets one item
    # While it holds a row long for the job, no more than that row can run beside (``pacing``).
    pace = pacing.pace_for(pool, worker, now, cost, len(pool.members(now) | {worker}))
    spread = None
    if num_turns > 1:
        spread = Spread(sorted(cost.values()),
                         sorted(cost[i] for i, lease in pool.leases.items() if lease.worker != worker),
                         sorted(cost[i] for i, lease in pool.leases.items() if lease.worker == worker),
                         num_turns)
    chosen = []
    for item_id in leasable:
        if len(chosen) == max_items:
            break
        # Given back (the move rule placed it), or its own (an owner starts its rows where it
        # has room: they would run nowhere sooner): no share to keep.
        free = free_for(pool.items[item_id], worker)
        if not free and chosen and quota < cost[item_id]:
            continue  # a shorter one further on may still fit the share
        if not free and spread is not None and not spread.allows(cost[item_id], len(chosen)):
            continue  # another member's turn: a shorter one may still be this worker's
        # (A sequence given back is the move rule's placement, which weighed this worker's steps.)
        if pace is not None and pool.items[item_id].not_for is None and not pace.admits(
                cost[item_id], now - pool.pacing.homed.get(item_id, now)):
            if pace.left_for_home:
                pool.pacing.homed.setdefault(item_id, now)
            if pace.at_cap(cost[item_id]):
                break  # its running set is at the pace of what it holds: no shorter one fits either
            continue  # it would run beside a long row, or a paced worker has a home for it
        if pace is not None:
            pool.pacing.homed.pop(item_id, None)
        chosen.append(item_id)
        quota -= cost[item_id]
        if pace is not None:
            pace.taken(cost[item_id])
    pacing.record(pool, worker, pace, now)
    for item_id in chosen:
        pool.pending.remove(item_id)
        item = pool.items[item_id]
        item.attempts += 1
        if item.not_for == worker and item.num_moves:
            item.num_moves -= 1  # nobody took it: back where it was, it never moved
        pool.leases[item_id] = Lease(worker, now + pool.lease_timeout_s)
        taken.append(item)
        if item.prefix is not None:
            mine[item.prefix] = None
            mine.move_to_end(item.prefix)
            if len(mine) > _PREFIXES_PER_WORKER:
                mine.popitem(last=False)
    if worker in pool.loads:
        pool.loads[worker].leased_since += taken
    pool.counters.leased_by_worker[worker] = pool.counters.leased_by_worker.get(worker, 0) + len(taken)
    return taken


def free_for(item: WorkItem, worker: str) -> bool:
    """Taken without a share: its own (an owner starts its rows where it has room: they would
    start nowhere sooner), or given back (the move rule placed it)."""
    return item.owner == worker or item.not_for is not None


def busy_workers(pool: WorkPool) -> set[str]:
    """The workers holding leased items (their engines are stepping them)."""
    return {lease.worker for lease in pool.leases.values()}


def compute_shares(pool: WorkPool, now: float) -> dict:
    """The alive workers' ``ComputeShare`` as their last reports gave it."""
    return {w: load.progress.compute for w, load in pool.loads.items()
            if load.progress.compute is not None and pool.is_alive(w, now)}


def _reserved_for_owners(pool: WorkPool, worker: str, cost: dict[str, float], now: float) -> set[str]:
    """Other owners' pending items that their owners will start themselves now: for each alive
    owner, its longest pending items (those of a prompt prefix it ran lately first, as it would
    lease them) up to the running slots it has free (``_room``).
    ``worker`` takes another owner's items only beyond that (they would wait there): work
    moves where it would otherwise queue, not where it would run anyway (moving it then only
    spreads rows over more engines, each stepping fewer of them)."""
    by_owner: dict[str, list[str]] = {}
    for item_id in pool.pending:
        item = pool.items[item_id]
        if item.owner != worker and item.not_for is None:
            by_owner.setdefault(item.owner, []).append(item_id)
    reserved: set[str] = set()
    for owner, ids in by_owner.items():
        if not pool.is_alive(owner, now):
            continue
        room = _room(pool, owner)
        if room > 0:
            cached = pool.prefixes.get(owner, {})  # as ``lease`` would order them for it
            ids.sort(key=lambda i: (-cost[i], pool.items[i].prefix not in cached))
            reserved.update(ids[:room])
    return reserved


def _room(pool: WorkPool, owner: str) -> int:
    """Running slots ``owner`` has free for its own items now: what its held lease call asks
    for, else its last report's free slots less the items leased to it since; all of them
    before its first lease (an engine that just submitted its first rows is empty)."""
    held = pool.holds(owner)
    if held is not None:
        return min(held, pool.pacing.room.get(owner, held))
    load = pool.loads.get(owner)
    if load is None:
        return len(pool.pending)
    return max(0, load.progress.free_slots - len(leased_since(load, pool.leases, owner)))


def kept_from(item: WorkItem, worker: str, now: float) -> bool:
    """A sequence given back a moment ago is kept from the worker that gave it back, and from
    every worker but the receiver its move was planned for, until ``not_for_until``."""
    if now >= item.not_for_until:
        return False
    return item.not_for == worker or (item.meant_for is not None and worker != item.meant_for)
