"""The shared work pool of one ``map_batches`` stage: items, leases, results. Pure Python.

Owners (the operator actors Ray Data hands batches to) submit their rows as items; every actor's
engine leases items to keep its running set full and completes them; an owner collects its
batch's results and emits the rows. Exactly-once output follows from three rules:

1. Only the owner emits a row, once, from the results of its own batch call; Ray Data keeps the
   output of one successful call per batch. Every call submits its rows under a key of its own
   (two equal batches are two batches: unseeded sampled rows get their own samples), and a
   retried call is a new batch.
2. A result is recorded once per item (the first completion wins); a late duplicate, from a lease
   that expired while its worker was merely slow, is dropped.
3. A lease ends with a result, with a release, or with the worker's death or lease expiry, and
   then the item goes back to ``pending``: no leased item is ever lost.

A batch lives until its owner takes its results, and no longer than its waiter: a batch whose
caller gave up (``forget_batch``) or whose owner died or fell silent for a lease timeout
(``drop_orphaned_batches``) leaves the pool with its items and results.

Who shares the work: the stage's members (``members.py``: the workers taking part now, and those
that registered as their actor started and may still come); a worker holds at most its fair share
of the outstanding work over them, and while one has not leased yet the longest items go
round-robin.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any

from batchgen_data.distributed.compute import joining
from batchgen_data.distributed.members import Members, Spread
from batchgen_data.distributed.work_item import WorkItem, prefix_key
from batchgen_data.engine.core.progress import SeqProgress
from batchgen_data.engine.migration.lengths import OutputLengths
from batchgen_data.engine.migration.planner import Move, WorkerProgress, plan_moves
from batchgen_data.engine.migration.step_model import StepSums

# After giving sequences back, a worker is not asked again for this long (the receivers'
# load reports must catch up first, or the pool would over-give): with the planner's gain
# margin, the time half of the hysteresis.
_PARTITION_COOLDOWN_S = 1.0
# How long a given-back sequence is kept from the worker that gave it back.
_GIVEN_BACK_RESERVE_S = 1.0
# Cache affinity: each worker remembers the prefix keys (``work_item.prefix_key``) of the items
# it leased most recently, as a stand-in for the prefixes its engine's cache holds.
_PREFIXES_PER_WORKER = 64


@dataclass(slots=True)
class _Batch:
    owner: str
    item_ids: list[str]


@dataclass(slots=True)
class _Load:
    progress: WorkerProgress  # the worker's last load report
    seen: float
    leased_since: list = field(default_factory=list)  # items leased to it with or after that report


def _unreported(item: WorkItem, tokens_left: float) -> SeqProgress:
    """An item leased to a worker after its last report, as the waiting sequence it is about to
    be there (not movable: its engine has no id for it yet)."""
    return SeqProgress(item.num_generated, item.num_generated + max(1, round(tokens_left)), item.num_generated,
                       started=False, movable=False, running=False)


@dataclass(slots=True)
class _Lease:
    worker: str
    deadline: float


@dataclass(slots=True)
class PoolCounters:
    num_submitted: int = 0
    num_completed: int = 0
    num_moved: int = 0  # completed by a worker other than the owner
    num_requeued: int = 0  # leases returned after a worker death or expiry (work redone)
    num_duplicates_dropped: int = 0
    num_migrated: int = 0  # sequences given back at the tail, to be continued elsewhere
    num_moves_planned: int = 0  # sequences the tail plans named (each one is given back)
    num_moves_declined: int = 0  # tail plans whose estimated gain missed the margin (nothing moved)
    num_batches_dropped: int = 0  # batches whose waiter was gone (caller gave up, owner dead)
    num_members_at_first_lease: int = 0  # how many workers the pool's first lease shared the work over
    leased_by_worker: dict = field(default_factory=dict)


class WorkPool:
    def __init__(self, lease_timeout_s: float = 30.0):
        self.lease_timeout_s = lease_timeout_s
        self.items: dict[str, WorkItem] = {}
        self.pending: deque[str] = deque()
        self.leases: dict[str, _Lease] = {}
        self.results: dict[str, Any] = {}
        self.batches: dict[str, _Batch] = {}
        self.last_heard: dict[str, float] = {}  # worker -> last call of any kind (who is alive)
        self.loads: dict[str, _Load] = {}
        self.last_gave: dict[str, float] = {}
        self.membership = Members(lease_timeout_s)
        self.num_reports = 0  # load reports received (a tail plan changes only with them, or the clock)
        self.prefixes: dict[str, OrderedDict] = {}  # worker -> prefix keys it leased lately
        self.lengths = OutputLengths()  # the job's finished output lengths, by max_tokens
        self.counters = PoolCounters()

    # -- owners ---------------------------------------------------------------------------------

    def submit(self, batch_key: str, owner: str, rows: list[tuple[Any, dict]], now: float = 0.0) -> None:
        """Add a batch's rows under ``batch_key`` (one per owner call: equal rows of another call
        are another batch); the same key again adds nothing."""
        self.last_heard[owner] = max(now, self.last_heard.get(owner, now))
        if batch_key in self.batches:
            return
        ids = []
        for index, (prompt, params) in enumerate(rows):
            item_id = f"{batch_key}/{index}"
            self.items[item_id] = WorkItem(item_id, batch_key, owner, prompt, params, prefix=prefix_key(prompt))
            self.pending.append(item_id)
            ids.append(item_id)
        self.batches[batch_key] = _Batch(owner, ids)
        self.counters.num_submitted += len(ids)

    def batch_done(self, batch_key: str) -> bool:
        """All its results are in, or it is gone (``take_batch`` then says None)."""
        batch = self.batches.get(batch_key)
        return batch is None or all(i in self.results for i in batch.item_ids)

    def take_batch(self, batch_key: str) -> list[Any] | None:
        """The batch's results in row order, and the batch forgotten; None if it was dropped."""
        batch = self.batches.get(batch_key)
        if batch is None:
            return None
        results = [self.results[i] for i in batch.item_ids]
        self._forget(batch_key)
        return results

    def forget_batch(self, batch_key: str) -> None:
        """Drop a batch whose caller gave up waiting: its items and results leave the pool."""
        if batch_key in self.batches:
            self._forget(batch_key)
            self.counters.num_batches_dropped += 1

    def drop_orphaned_batches(self, now: float) -> list[str]:
        """Drop the batches of owners not heard from for a lease timeout (dead: nobody will take
        their results; Ray Data retries such a call as a new batch). Returns their keys."""
        orphaned = [key for key, batch in self.batches.items()
                    if now - self.last_heard.get(batch.owner, now) > self.lease_timeout_s]
        for key in orphaned:
            self.forget_batch(key)
        return orphaned

    def _forget(self, batch_key: str) -> None:
        for item_id in self.batches.pop(batch_key).item_ids:
            self.results.pop(item_id, None)
            self.items.pop(item_id, None)
            self.leases.pop(item_id, None)  # a late result for it is dropped (``complete``)
            if item_id in self.pending:
                self.pending.remove(item_id)

    # -- workers --------------------------------------------------------------------------------

    def register(self, worker: str, now: float, ready: bool = False, load_s: float | None = None) -> None:
        """A stage actor joins: when it starts (before loading its model), and again with
        ``ready`` once its engine is built, ``load_s`` seconds after it started. It counts among
        the ``members`` from then on."""
        self.membership.register(worker, now, ready, load_s)
        self.last_heard[worker] = max(now, self.last_heard.get(worker, now))

    def members(self, now: float) -> set[str]:
        """The workers the outstanding work is shared among (``Members.current``)."""
        return self.membership.current(now)

    def is_alive(self, worker: str, now: float) -> bool:
        """A lease call of it is held open, or it was heard from within a lease timeout."""
        return (worker in self.membership.holding
                or now - self.last_heard.get(worker, -math.inf) <= self.lease_timeout_s)

    def hold(self, worker: str, max_items: int, now: float) -> None:
        """The coordinator holds a lease call of ``worker`` open (asking for ``max_items``): it is
        alive, and with ``max_items`` > 0 it takes work now (a receiver at the tail)."""
        self.membership.holding[worker] = max_items
        self.heartbeat(worker, now)

    def unhold(self, worker: str) -> None:
        self.membership.holding.pop(worker, None)

    def holds(self, worker: str) -> int | None:
        """``max_items`` of the lease call of ``worker`` held open now; None if none is."""
        return self.membership.holding.get(worker)

    def refresh_held(self, now: float) -> None:
        """Renew the leases of the workers whose calls are held (alive, waiting on the pool)."""
        for worker in self.membership.holding:
            self.heartbeat(worker, now)

    def next_change_s(self, worker: str, now: float) -> float | None:
        """The earliest time at which this pool could answer ``worker`` differently with no event
        in between (a given-back item no longer kept from it, its give-back cooldown over, a
        member no longer waited for); None if nothing is timed."""
        times = [self.items[i].not_for_until for i in self.pending if self.items[i].not_for == worker]
        if worker in self.last_gave:
            times.append(self.last_gave[worker] + _PARTITION_COOLDOWN_S)
        times += self.membership.waited_until_times()
        return min((t for t in times if now < t < math.inf), default=None)

    def cost(self, item: WorkItem) -> float:
        """Work estimate in tokens: the output an item has left (its ``max_tokens`` budget,
        lowered by the lengths of finished rows with the same budget) dominates a decode-bound
        batch job."""
        return self.lengths.tokens_left(item.num_generated, item.max_tokens) + 1

    def lease(self, worker: str, max_items: int, now: float, progress: WorkerProgress | None = None,
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
        one item.
        ``progress`` (its engine's sequences, step times and move cost) is its load report for
        ``plan_give_back``.
        """
        self.expire(now)
        self.last_heard[worker] = now
        if progress is not None:
            self.loads[worker] = _Load(progress, now)
            self.num_reports += 1
        members = self.members(now) | {worker}
        if not self.membership.last_seen:
            self.counters.num_members_at_first_lease = len(members)
        # Only those that would add compute share the rows that queue (``compute.joining``).
        busy, shares = self._busy(), self._shares(now)
        members &= busy | joining([worker, *sorted(members - {worker})], shares, busy)
        joins = worker in members
        num_turns = self.membership.num_turns(worker, members | {worker})
        self.membership.saw_lease(worker, now)
        taken: list[WorkItem] = []
        if max_items <= 0 or not self.pending:
            return taken
        # Longest first (by estimated tokens left), the worker's own items first among equals:
        # long rows start early and overlap with short ones instead of forming the job's tail
        # (longest-processing-time-first, the classic makespan rule for parallel machines).
        cost = {i: self.cost(self.items[i]) for i in (*self.pending, *self.leases)}
        reserved = self._reserved_for_owners(worker, cost, now)
        leasable = [i for i in self.pending if not self._kept_from(self.items[i], worker, now) and i not in reserved
                    and (joins or self._free_for(self.items[i], worker))]
        mine = self.prefixes.setdefault(worker, OrderedDict())
        leasable.sort(key=lambda i: (-cost[i], self.items[i].prefix not in mine,
                                     self.items[i].owner != worker))
        # Work held outside the pool counts too: rows actors started on their own engines.
        local = {w: load.progress.local_tokens for w, load in self.loads.items() if self.is_alive(w, now)}
        held = sum(cost[i] for i, lease in self.leases.items() if lease.worker == worker) + local.get(worker, 0)
        outstanding = sum(cost.values()) + sum(local.values())
        quota = -(-outstanding // max(1, len(members))) - held
        if quota <= 0 and held > 0 and not any(self._free_for(self.items[i], worker) for i in leasable):
            return taken  # over its share already; a worker holding nothing always gets one item
        spread = None
        if num_turns > 1:
            spread = Spread(sorted(cost.values()),
                             sorted(cost[i] for i, lease in self.leases.items() if lease.worker != worker),
                             sorted(cost[i] for i, lease in self.leases.items() if lease.worker == worker),
                             num_turns)
        chosen = []
        for item_id in leasable:
            if len(chosen) == max_items:
                break
            # Given back (the move rule placed it), or its own (an owner starts its rows where it
            # has room: they would run nowhere sooner): no share to keep.
            free = self._free_for(self.items[item_id], worker)
            if not free and chosen and quota < cost[item_id]:
                continue  # a shorter one further on may still fit the share
            if not free and spread is not None and not spread.allows(cost[item_id], len(chosen)):
                continue  # another member's turn: a shorter one may still be this worker's
            chosen.append(item_id)
            quota -= cost[item_id]
        for item_id in chosen:
            self.pending.remove(item_id)
            item = self.items[item_id]
            item.attempts += 1
            if item.not_for == worker and item.num_moves:
                item.num_moves -= 1  # nobody took it: back where it was, it never moved
            self.leases[item_id] = _Lease(worker, now + self.lease_timeout_s)
            taken.append(item)
            if item.prefix is not None:
                mine[item.prefix] = None
                mine.move_to_end(item.prefix)
                if len(mine) > _PREFIXES_PER_WORKER:
                    mine.popitem(last=False)
        if worker in self.loads:
            self.loads[worker].leased_since += taken
        self.counters.leased_by_worker[worker] = self.counters.leased_by_worker.get(worker, 0) + len(taken)
        return taken

    @staticmethod
    def _free_for(item: WorkItem, worker: str) -> bool:
        """Taken without a share: its own (an owner starts its rows where it has room: they would
        start nowhere sooner), or given back (the move rule placed it)."""
        return item.owner == worker or item.not_for is not None

    def _busy(self) -> set[str]:
        """The workers holding leased items (their engines are stepping them)."""
        return {lease.worker for lease in self.leases.values()}

    def _shares(self, now: float) -> dict:
        """The alive workers' ``ComputeShare`` as their last reports gave it."""
        return {w: load.progress.compute for w, load in self.loads.items()
                if load.progress.compute is not None and self.is_alive(w, now)}

    def _reserved_for_owners(self, worker: str, cost: dict[str, float], now: float) -> set[str]:
        """Other owners' pending items that their owners will start themselves now: for each alive
        owner, its longest pending items (those of a prompt prefix it ran lately first, as it would
        lease them) up to the running slots it has free (``_room``).
        ``worker`` takes another owner's items only beyond that (they would wait there): work
        moves where it would otherwise queue, not where it would run anyway (moving it then only
        spreads rows over more engines, each stepping fewer of them)."""
        by_owner: dict[str, list[str]] = {}
        for item_id in self.pending:
            item = self.items[item_id]
            if item.owner != worker and item.not_for is None:
                by_owner.setdefault(item.owner, []).append(item_id)
        reserved: set[str] = set()
        for owner, ids in by_owner.items():
            if not self.is_alive(owner, now):
                continue
            room = self._room(owner)
            if room > 0:
                cached = self.prefixes.get(owner, {})  # as ``lease`` would order them for it
                ids.sort(key=lambda i: (-cost[i], self.items[i].prefix not in cached))
                reserved.update(ids[:room])
        return reserved

    def _room(self, owner: str) -> int:
        """Running slots ``owner`` has free for its own items now: what its held lease call asks
        for, else its last report's free slots less the items leased to it since; all of them
        before its first lease (an engine that just submitted its first rows is empty)."""
        held = self.holds(owner)
        if held is not None:
            return held
        load = self.loads.get(owner)
        if load is None:
            return len(self.pending)
        since = sum(1 for item in load.leased_since
                    if (lease := self.leases.get(item.item_id)) is not None and lease.worker == owner)
        return max(0, load.progress.free_slots - since)

    def plan_give_back(self, worker: str, now: float) -> list[Move]:
        """PARTITION at the tail: which of its sequences ``worker`` should give back.

        Only once nothing is pending (idle actors take unstarted work first), not within the
        cooldown after its last give-back, and only those ``plan_moves`` names: the alive
        workers' reports, each carried forward to ``now`` by the stage's step model
        (``WorkerProgress.advanced``: a worker whose call is held reported when it called),
        receivers being those that take work now (``Members.takes_work``) with empty slots; the stage's pooled step model (calibrated lines
        at the measured level); and the learned output lengths must show the moves paying for
        themselves (``engine/migration/planner.py``). The worker exports exactly these, so
        ``num_moves_planned`` counts sequences that are given back.
        """
        me = self.loads.get(worker)
        if self.pending or me is None or now - self.last_gave.get(worker, -1e9) < _PARTITION_COOLDOWN_S:
            return []
        alive = {w: load for w, load in self.loads.items() if w == worker or self.is_alive(w, now)}
        pooled = StepSums()
        for load in alive.values():
            pooled = pooled.merged(load.progress.step)
        model = pooled.fit()
        reports = {w: self._report_now(w, load, now, model) for w, load in alive.items()}
        busy = self._busy() | {worker}
        takers = sorted(w for w, p in reports.items()
                        if w != worker and p.free_slots > 0 and self.membership.takes_work(w, now))
        joined = joining(takers, self._shares(now), busy)  # an idle one only where it adds compute
        receivers = [reports[w] for w in takers if w in busy or w in joined]
        if not receivers or not any(s.movable for s in reports[worker].seqs):
            return []
        plan = plan_moves(reports[worker], receivers, self.lengths, model)
        self.counters.num_moves_planned += plan.count
        if not plan.count and plan.missed_s > 0:
            self.counters.num_moves_declined += 1
        return list(plan.moves)

    def _report_now(self, worker: str, load: _Load, now: float, model) -> WorkerProgress:
        """A worker's last report carried forward to ``now``, with the items leased to it since
        (not in its engine when it reported; the ones it finished since are gone)."""
        report = load.progress.advanced(now - load.seen, model)
        unreported = [item for item in load.leased_since
                      if (lease := self.leases.get(item.item_id)) is not None and lease.worker == worker]
        if not unreported:
            return report
        extra = tuple(_unreported(item, self.cost(item) - 1) for item in unreported)
        return replace(report, seqs=report.seqs + extra)

    def give_back(self, worker: str, item_id: str, state: Any, num_generated: int, now: float) -> bool:
        """End a lease with the sequence's exported state: the item is pending again, to be
        continued by another worker. False (state dropped) if the lease is no longer this
        worker's: it expired and the item is already pending or running elsewhere."""
        lease = self.leases.get(item_id)
        if lease is None or lease.worker != worker or item_id in self.results:
            return False
        item = self.items[item_id]
        del self.leases[item_id]
        item.state, item.num_generated = state, num_generated
        item.not_for, item.not_for_until = worker, now + _GIVEN_BACK_RESERVE_S
        item.num_moves += 1
        self.pending.appendleft(item_id)
        self.last_gave[worker] = now
        self.counters.num_migrated += 1
        return True

    @staticmethod
    def _kept_from(item: WorkItem, worker: str, now: float) -> bool:
        return item.not_for == worker and now < item.not_for_until

    def heartbeat(self, worker: str, now: float) -> None:
        self.last_heard[worker] = now
        for lease in self.leases.values():
            if lease.worker == worker:
                lease.deadline = now + self.lease_timeout_s

    def complete(self, worker: str, item_id: str, result: Any, num_generated: int | None = None) -> bool:
        """Record a result (``num_generated``: its output length, learned for estimates);
        False if the item already has one (or is gone)."""
        if item_id not in self.items or item_id in self.results:
            self.counters.num_duplicates_dropped += 1
            return False
        self.results[item_id] = result
        if num_generated is not None:
            self.lengths.record(self.items[item_id].max_tokens, num_generated)
        self.leases.pop(item_id, None)
        if item_id in self.pending:  # finished by a worker whose lease had expired
            self.pending.remove(item_id)
        self.counters.num_completed += 1
        if worker != self.items[item_id].owner:
            self.counters.num_moved += 1
        return True

    def release(self, worker: str, item_ids: list[str]) -> None:
        """Give back leased items the worker will not run (they go to the front of the queue)."""
        for item_id in item_ids:
            lease = self.leases.get(item_id)
            if lease is not None and lease.worker == worker and item_id not in self.results:
                del self.leases[item_id]
                self.pending.appendleft(item_id)

    def worker_died(self, worker: str) -> int:
        """Its leases go back to pending, and its own batches leave (nobody will take them)."""
        self.loads.pop(worker, None)
        self.membership.forget(worker)
        for key in [key for key, batch in self.batches.items() if batch.owner == worker]:
            self.forget_batch(key)
        lost = [i for i, lease in self.leases.items() if lease.worker == worker]
        for item_id in lost:
            del self.leases[item_id]
            self.pending.appendleft(item_id)
        self.counters.num_requeued += len(lost)
        return len(lost)

    def expire(self, now: float) -> int:
        expired = [i for i, lease in self.leases.items() if lease.deadline < now]
        for item_id in expired:
            del self.leases[item_id]
            self.pending.appendleft(item_id)
        self.counters.num_requeued += len(expired)
        return len(expired)

    @property
    def num_outstanding(self) -> int:
        return len(self.pending) + len(self.leases)
