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
from typing import Any

from batchgen_data.rebalance.core import leasing, moved, tail
from batchgen_data.rebalance.core.lengths import OutputLengths
from batchgen_data.rebalance.core.members import Members
from batchgen_data.rebalance.core.move_rule import Move
from batchgen_data.rebalance.core.pacing import PaceState
from batchgen_data.rebalance.core.pool_state import Batch, Lease, Load, PoolCounters
from batchgen_data.rebalance.core.progress import WorkerProgress
from batchgen_data.rebalance.core.step_model import StepSums
from batchgen_data.rebalance.core.tail import PARTITION_COOLDOWN_S
from batchgen_data.rebalance.core.work_item import WorkItem, prefix_key

class WorkPool:
    def __init__(self, lease_timeout_s: float = 30.0):
        self.lease_timeout_s = lease_timeout_s
        self.items: dict[str, WorkItem] = {}
        self.pending: deque[str] = deque()
        self.leases: dict[str, Lease] = {}
        self.results: dict[str, Any] = {}
        self.batches: dict[str, Batch] = {}
        self.last_heard: dict[str, float] = {}  # worker -> last call of any kind (who is alive)
        self.loads: dict[str, Load] = {}
        self.last_gave: dict[str, float] = {}
        self.planned_moves: dict[str, dict[int, str]] = {}  # giver -> request id -> receiver, its last tail plan
        self.membership = Members(lease_timeout_s)
        self.num_reports = 0  # load reports received (a tail plan changes only with them, or the clock)
        self.prefixes: dict[str, OrderedDict] = {}  # worker -> prefix keys it leased lately
        self.lengths = OutputLengths()  # the job's finished output lengths, by max_tokens
        self.counters = PoolCounters()
        self._next_expiry = -math.inf  # no lease expires before this (``expire``)
        self.step_total = StepSums()  # every recorded report's step sums, added up (``set_load``)
        self.renewed: dict[str, float] = {}  # worker -> its last heartbeat (its leases last from then)
        self.owners: set[str] = set()  # workers that submitted a batch (had a block to run)
        self.pacing = PaceState()  # who runs small sets beside long rows (``pacing``)

    # -- owners ---------------------------------------------------------------------------------

    def submit(self, batch_key: str, owner: str, rows: list[tuple[Any, dict]], now: float = 0.0) -> None:
        """Add a batch's rows under ``batch_key`` (one per owner call: equal rows of another call
        are another batch); the same key again adds nothing."""
        self.last_heard[owner] = max(now, self.last_heard.get(owner, now))
        if batch_key in self.batches:
            return
        if any("max_tokens" not in params for _, params in rows):
            raise ValueError("every row's params name its max_tokens (SamplingParams.to_dict)")
        ids = []
        for index, (prompt, params) in enumerate(rows):
            item_id = f"{batch_key}/{index}"
            self.items[item_id] = WorkItem(item_id, batch_key, owner, prompt, params, prefix=prefix_key(prompt))
            self.pending.append(item_id)
            ids.append(item_id)
        self.batches[batch_key] = Batch(owner, ids)
        self.owners.add(owner)
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
            self.pacing.homed.pop(item_id, None)
            if item_id in self.pending:
                self.pending.remove(item_id)

    # -- workers --------------------------------------------------------------------------------

    def register(self, worker: str, now: float, ready: bool = False, load_s: float | None = None) -> None:
        """A stage actor joins: when it starts (before loading its model), and again with
        ``ready`` once its engine is built, ``load_s`` seconds after it started. It counts among
        the ``members`` from then on."""
        self.membership.register(worker, now, ready, load_s)
        self.last_heard[worker] = max(now, self.last_heard.get(worker, now))

    def set_load(self, worker: str, load: Load | None) -> None:
        """Record a worker's latest load report (None: forget it), keeping ``step_total``, the
        sum of every recorded report's ``StepSums``, in step."""
        old = self.loads.pop(worker, None)
        if old is not None:
            self.step_total = self.step_total.minus(old.progress.step)
        if load is not None:
            load.local_rows = sum(1 for s in load.progress.seqs if s.movable and not s.in_pool)
            self.loads[worker] = load
            self.step_total = self.step_total.merged(load.progress.step)

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
        times = [self.items[i].not_for_until for i in self.pending if leasing.kept_from(self.items[i], worker, now)]
        if worker in self.last_gave:
            times.append(self.last_gave[worker] + PARTITION_COOLDOWN_S)
        times += self.membership.waited_until_times()
        return min((t for t in times if now < t < math.inf), default=None)

    def cost(self, item: WorkItem) -> float:
        """Work estimate in tokens: the output an item has left (its ``max_tokens`` budget,
        lowered by the lengths of finished rows with the same budget) dominates a decode-bound
        batch job."""
        return self.lengths.tokens_left(item.num_generated, item.max_tokens) + 1


    def lease(self, worker: str, max_items: int, now: float, progress: WorkerProgress | None = None,
              ) -> list[WorkItem]:
        """Up to ``max_items`` pending items for ``worker`` (``leasing.lease``: the longest first,
        its fair share, other owners' items only where they would queue); ``progress`` is its load
        report."""
        return leasing.lease(self, worker, max_items, now, progress)

    def plan_give_back(self, worker: str, now: float) -> list[Move]:
        """The sequences ``worker`` should give back at the tail (``tail.plan_give_back``)."""
        return tail.plan_give_back(self, worker, now)

    def give_back(self, worker: str, item_id: str, state: Any, num_generated: int, now: float,
                  request_id: int | None = None) -> bool:
        """End a lease with the sequence's exported state: the item is pending again, to be
        continued by another worker, kept for the receiver its move was planned for (by the
        giver engine's ``request_id``, as the plan named it) for a while. False (state dropped)
        if the lease is no longer this worker's: it expired and the item is already pending or
        running elsewhere."""
        return moved.give_back(self, worker, item_id, state, num_generated, now, request_id)

    def adopt(self, worker: str, batch_key: str, prompt: Any, params: dict, state: Any, num_generated: int,
              now: float, request_id: int | None = None) -> bool:
        """A row ``worker`` ran outside the pool, exported by a planned move, enters the pool as
        the one item of its own batch ``batch_key`` (``moved.adopt``)."""
        return moved.adopt(self, worker, batch_key, prompt, params, state, num_generated, now, request_id)

    def heartbeat(self, worker: str, now: float) -> None:
        """``worker`` is alive: every lease of its lasts until a lease timeout from now (its
        leases' deadlines are read through ``renewed``, so this is O(1) however many it holds)."""
        self.last_heard[worker] = now
        self.renewed[worker] = max(now, self.renewed.get(worker, now))

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
        self.set_load(worker, None)
        self.membership.forget(worker)
        self.pacing.forget(worker)  # no home for long items any more
        for key in [key for key, batch in self.batches.items() if batch.owner == worker]:
            self.forget_batch(key)
        lost = [i for i, lease in self.leases.items() if lease.worker == worker]
        for item_id in lost:
            del self.leases[item_id]
            self.pending.appendleft(item_id)
        self.counters.num_requeued += len(lost)
        return len(lost)

    def _deadline(self, lease: Lease) -> float:
        """When a lease expires: a lease timeout after it was granted or its worker's last
        heartbeat, whichever is later."""
        return max(lease.deadline, self.renewed.get(lease.worker, -math.inf) + self.lease_timeout_s)

    def expire(self, now: float) -> int:
        """Leases past their deadline go back to pending. Deadlines are set ``lease_timeout_s``
        after a call and only move later, so none expires before the earliest one seen at the
        last scan (``_next_expiry``): a lease call's check is O(1) until then."""
        if now <= self._next_expiry:
            return 0
        expired = [i for i, lease in self.leases.items() if self._deadline(lease) < now]
        self._next_expiry = min((d for lease in self.leases.values() if (d := self._deadline(lease)) >= now),
                                default=now)
        for item_id in expired:
            del self.leases[item_id]
            self.pending.appendleft(item_id)
        self.counters.num_requeued += len(expired)
        return len(expired)

    @property
    def num_outstanding(self) -> int:
        return len(self.pending) + len(self.leases)

    def outstanding(self, now: float) -> int:
        """Rows of the stage that could still come to a worker: pending, leased, and the movable
        rows alive workers run outside the pool (a tail plan may move them): while there are
        any, an actor keeps its last call open to receive them."""
        return self.num_outstanding + sum(load.local_rows for w, load in self.loads.items() if self.is_alive(w, now))
