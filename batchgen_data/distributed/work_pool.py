"""The shared work pool of one ``map_batches`` stage: items, leases, results. Pure Python.

Owners (the operator actors Ray Data hands batches to) submit their rows as items; every actor's
engine leases items to keep its running set full and completes them; an owner collects its
batch's results and emits the rows. Exactly-once output follows from three rules:

1. Only the owner emits a row, once, from the results of its own batch call; Ray Data keeps the
   output of one successful call per batch (a retried call's owner resubmits the same batch key
   and gets the finished results, or waits for the rest).
2. A result is recorded once per item (the first completion wins); a late duplicate, from a lease
   that expired while its worker was merely slow, is dropped.
3. A lease ends with a result, with a release, or with the worker's death or lease expiry, and
   then the item goes back to ``pending``: no leased item is ever lost.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.distributed.move_planner import OutputLengths, WorkerProgress, plan_moves
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.migration.step_model import StepSums

# A worker that asked for work this recently counts as active when sharing out pending items.
_ACTIVE_WINDOW_S = 1.0
# After giving sequences back, a worker is not asked again for this long (the receivers'
# load reports must catch up first, or the pool would over-give): with the planner's gain
# margin, the time half of the hysteresis.
_PARTITION_COOLDOWN_S = 1.0
# How long a given-back sequence is kept from the worker that gave it back.
_GIVEN_BACK_RESERVE_S = 1.0
# A sequence moves at most this many times: with the cooldown and the empty-slots rule this
# bounds ping-pong, and leaves the late stragglers (the most moved) still movable at the tail.
_MAX_MOVES = 4
# Cache affinity: an item's prefix key is the head of its prompt (characters of a text prompt,
# token ids, the first chat message); each worker remembers the keys of the items it leased
# most recently, as a stand-in for the prefixes its engine's cache holds.
_PREFIX_KEY_CHARS = 256
_PREFIX_KEY_TOKENS = 64
_PREFIXES_PER_WORKER = 64


def prefix_key(prompt: Any) -> Any:
    """What rows sharing a prompt prefix (one instruction template) have in common: the first
    characters of a text prompt, the first token ids, or the first chat message; None otherwise."""
    if isinstance(prompt, str):
        return prompt[:_PREFIX_KEY_CHARS]
    prompt = getattr(prompt, "messages", prompt)  # a ChatPrompt: its messages
    if isinstance(prompt, (list, tuple)) and prompt:
        first = prompt[0]
        if isinstance(first, dict):
            return ("messages", str(first.get("role")), str(first.get("content"))[:_PREFIX_KEY_CHARS])
        if all(isinstance(t, int) for t in prompt[:_PREFIX_KEY_TOKENS]):
            return tuple(prompt[:_PREFIX_KEY_TOKENS])
    return None


@dataclass(slots=True)
class WorkItem:
    item_id: str  # "<batch key>/<row index>"
    batch_key: str
    owner: str
    prompt: Any
    params: dict  # SamplingParams fields, plain data
    attempts: int = 0
    state: Any = None  # a started sequence given back mid-generation (MIGRATE), opaque here
    num_generated: int = 0  # tokens the given-back state already holds
    num_moves: int = 0
    not_for: str | None = None  # the worker that gave it back does not lease it again ...
    not_for_until: float = 0.0  # ... for a while (then anyone may: no item waits on a gone worker)
    prefix: Any = None  # ``prefix_key(prompt)``: cache affinity

    @property
    def movable(self) -> bool:
        return self.num_moves < _MAX_MOVES

    @property
    def max_tokens(self) -> int:
        return int(self.params.get("max_tokens") or SamplingParams.defaults()["max_tokens"])


@dataclass(slots=True)
class _Load:
    progress: WorkerProgress  # the worker's last load report
    seen: float


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
    num_migrated: int = 0  # started sequences given back at the tail and continued elsewhere
    num_moves_planned: int = 0  # tail plans that asked a worker to give sequences back
    num_moves_declined: int = 0  # tail plans whose estimated gain missed the margin (nothing moved)
    leased_by_worker: dict = field(default_factory=dict)


class WorkPool:
    def __init__(self, lease_timeout_s: float = 30.0):
        self.lease_timeout_s = lease_timeout_s
        self.items: dict[str, WorkItem] = {}
        self.pending: deque[str] = deque()
        self.leases: dict[str, _Lease] = {}
        self.results: dict[str, Any] = {}
        self.batches: dict[str, list[str]] = {}
        self.batch_waiters: dict[str, int] = {}
        self.last_seen: dict[str, float] = {}  # worker -> last lease call (who is active)
        self.loads: dict[str, _Load] = {}
        self.last_gave: dict[str, float] = {}
        self.prefixes: dict[str, OrderedDict] = {}  # worker -> prefix keys it leased lately
        self.lengths = OutputLengths()  # the job's finished output lengths, by max_tokens
        self.counters = PoolCounters()

    # -- owners ---------------------------------------------------------------------------------

    def submit(self, batch_key: str, owner: str, rows: list[tuple[Any, dict]]) -> None:
        """Add a batch's rows; a batch key seen before (a retry, or identical rows) adds nothing."""
        self.batch_waiters[batch_key] = self.batch_waiters.get(batch_key, 0) + 1
        if batch_key in self.batches:
            return
        ids = []
        for index, (prompt, params) in enumerate(rows):
            item_id = f"{batch_key}/{index}"
            self.items[item_id] = WorkItem(item_id, batch_key, owner, prompt, params, prefix=prefix_key(prompt))
            self.pending.append(item_id)
            ids.append(item_id)
        self.batches[batch_key] = ids
        self.counters.num_submitted += len(ids)

    def batch_done(self, batch_key: str) -> bool:
        return all(i in self.results for i in self.batches.get(batch_key, ()))

    def take_batch(self, batch_key: str) -> list[Any]:
        """The batch's results in row order; forgotten once its last waiter has them."""
        results = [self.results[i] for i in self.batches[batch_key]]
        self.batch_waiters[batch_key] -= 1
        if self.batch_waiters[batch_key] <= 0:
            for item_id in self.batches.pop(batch_key):
                self.results.pop(item_id, None)
                self.items.pop(item_id, None)
            del self.batch_waiters[batch_key]
        return results

    # -- workers --------------------------------------------------------------------------------

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

        A worker holds at most its fair share of the outstanding work (pending plus leased, in
        estimated tokens, over the active workers, active = asked recently), so an owner does not
        hoard long rows another actor would start now. A worker holding nothing always gets one.
        ``progress`` (its engine's sequences, step times and move cost) is its load report for
        ``partition_share``.
        """
        self.expire(now)
        self.last_seen[worker] = now
        if progress is not None:
            self.loads[worker] = _Load(progress, now)
        taken: list[WorkItem] = []
        if max_items <= 0 or not self.pending:
            return taken
        # Longest first (by estimated tokens left), the worker's own items first among equals:
        # long rows start early and overlap with short ones instead of forming the job's tail
        # (longest-processing-time-first, the classic makespan rule for parallel machines).
        leasable = [i for i in self.pending if not self._kept_from(self.items[i], worker, now)]
        mine = self.prefixes.setdefault(worker, OrderedDict())
        cost = {i: self.cost(self.items[i]) for i in (*self.pending, *self.leases)}
        leasable.sort(key=lambda i: (-cost[i], self.items[i].prefix not in mine,
                                     self.items[i].owner != worker))
        active = sum(1 for t in self.last_seen.values() if now - t < _ACTIVE_WINDOW_S)
        held = sum(cost[i] for i, lease in self.leases.items() if lease.worker == worker)
        outstanding = sum(cost.values())
        quota = -(-outstanding // max(active, 1)) - held
        if quota <= 0 and held > 0:
            return taken  # over its share already; a worker holding nothing always gets one item
        chosen = []
        for item_id in leasable:
            if len(chosen) == max_items:
                break
            if chosen and quota < cost[item_id]:
                continue  # a shorter one further on may still fit the share
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
        self.counters.leased_by_worker[worker] = self.counters.leased_by_worker.get(worker, 0) + len(taken)
        return taken

    def partition_share(self, worker: str, now: float) -> int:
        """PARTITION at the tail: how many of its sequences ``worker`` should give back.

        Only once nothing is pending (idle actors take unstarted work first), not within the
        cooldown after its last give-back, and only as many as ``plan_moves`` finds worth it:
        the workers' reported sequences, the stage's pooled step times and the learned output
        lengths must show the later finish time of giver and receivers dropping by more than
        the planner's margin, net of the moves' cost. Otherwise nothing moves.
        """
        me = self.loads.get(worker)
        if self.pending or me is None or now - self.last_gave.get(worker, -1e9) < _PARTITION_COOLDOWN_S:
            return 0
        active = {w: load.progress for w, load in self.loads.items() if now - load.seen <= _ACTIVE_WINDOW_S}
        receivers = [p for w, p in active.items() if w != worker and p.free_slots > 0]
        if not receivers or not any(s.movable for s in me.progress.seqs):
            return 0
        pooled = StepSums()
        for progress in active.values():
            pooled = pooled.merged(progress.step)
        plan = plan_moves(me.progress, receivers, self.lengths, pooled.fit())
        if plan.count:
            self.counters.num_moves_planned += 1
        elif plan.gain_s > 0:
            self.counters.num_moves_declined += 1
        return plan.count

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
        self.loads.pop(worker, None)
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
