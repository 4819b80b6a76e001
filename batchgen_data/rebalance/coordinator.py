"""The per-stage coordinator: the shared ``WorkPool`` behind async calls, run as a Ray actor
(``ray_actor.py``) or in-process (tests, the simulator's transport).

The first operator actor creates it by name (detached, no CPUs) as it starts, before it loads its
model, and the others find it by the same name; each registers as a member of the stage then
(``register``). It is not a single point of data loss: owners keep their own rows and fall back
to running them locally when the coordinator cannot be reached (see ``rebalance/client``).
It exits by itself once idle with nothing outstanding.

NOTE: leases on events. A lease call that gets nothing is held open (``lease(wait_s=...)``)
until the pool has something for that worker: items it may take, a give-back planned for it, the
stage's pool emptied or refilled (the caller's last-known outstanding count says which it
saw), or its wait bound (``wait_s``, at most a third of the lease timeout); while it is held the
worker counts as alive and its leases are renewed. Every change that could answer a held call
differently (rows submitted, a result, a release, a give-back, a load report, an expiry, a timed
change of the pool's own: ``WorkPool.next_change_s``) wakes the held calls, which ask the pool
again (the tail plan only when a load report came in since, or the clock woke it: a plan is the
costly question). So an actor with room and nothing to take makes one call per wait bound, not
one per poll interval, and an item submitted reaches a waiting actor in one message.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen_data.rebalance.core.move_rule import Move
from batchgen_data.rebalance.core.pool import WorkPool
from batchgen_data.rebalance.core.progress import WorkerProgress

# How often the coordinator expires leases and drops the batches of silent owners (its only
# timer): a dead worker's rows return to the pool within a lease timeout plus this.
_HOUSEKEEPING_S = 1.0


@dataclass(slots=True)
class LeasedItem:
    item_id: str
    prompt: Any
    params: dict  # SamplingParams fields
    owner: str = ""
    state: bytes | None = None  # a pickled SequenceState to continue, when given back mid-generation
    movable: bool = True  # may be given back again at the tail
    num_generated: int = 0  # tokens its given-back state already holds


@dataclass(slots=True)
class LeaseReply:
    items: list[LeasedItem] = field(default_factory=list)
    give_back: list[Move] = field(default_factory=list)  # PARTITION: export exactly these (``plan_moves``)
    num_outstanding: int = 0  # the stage's pending and leased items, and rows run outside the pool that may move
    held_s: float = 0.0  # how long the coordinator held the call open (the rest is the round trip)


class Coordinator:
    """Actor body (wrapped with ``ray.remote`` by ``get_or_create_coordinator``)."""

    def __init__(self, lease_timeout_s: float = 30.0, idle_exit_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # every time the pool sees comes from it (injected: tests, simulation)
        self.pool = WorkPool(lease_timeout_s)
        self.idle_exit_s = idle_exit_s
        self.max_hold_s = lease_timeout_s / 3  # a held call renews its leases; three chances per timeout
        self._last_call = self.clock()
        self._done_events: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Event()  # replaced at every change: held calls wait on it
        self._woken: set[str] = set()  # workers whose held call should return now
        self._housekeeper: asyncio.Task | None = None
        self.num_lease_calls = 0
        self.num_lease_waits = 0  # held calls woken to ask the pool again

    def _touch(self) -> None:
        self._last_call = self.clock()
        if self._housekeeper is None:
            self._housekeeper = asyncio.get_running_loop().create_task(self._keep_house())

    def _notify(self) -> None:
        """Wake every held lease call to ask the pool again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _keep_house(self) -> None:
        """Expire the leases of silent workers and drop silent owners' batches (waking whoever
        waits on them), every ``_HOUSEKEEPING_S``; exit once idle with nothing outstanding."""
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            now = self.clock()
            pool = self.pool
            pool.refresh_held(now)
            dropped = pool.drop_orphaned_batches(now)
            for batch_key in dropped:
                self._wake_batch(batch_key)
            if pool.expire(now) or dropped:
                self._notify()
            is_idle = now - self._last_call > self.idle_exit_s and not pool.membership.holding
            if is_idle and pool.num_outstanding == 0:
                os._exit(0)  # detached: nobody else ends it

    async def register(self, worker: str, ready: bool = False, load_s: float | None = None) -> None:
        """A stage actor joins (``WorkPool.register``): as it starts, and ``ready`` once its
        engine is built, ``load_s`` seconds after it started."""
        self._touch()
        self.pool.register(worker, self.clock(), ready, load_s)
        self._notify()  # members changed: shares change

    async def submit(self, batch_key: str, owner: str, rows: list[tuple[Any, dict]]) -> None:
        self._touch()
        self.pool.submit(batch_key, owner, rows, self.clock())
        self._done_events.setdefault(batch_key, asyncio.Event())
        if self.pool.batch_done(batch_key):
            self._done_events[batch_key].set()
        self._notify()

    async def wait_batch(self, batch_key: str) -> list[Any] | None:
        """The batch's results once all are in; None if the pool dropped it (its owner was taken
        for dead, or the caller gave up): the owner then runs it on its own engine."""
        self._touch()
        event = self._done_events.setdefault(batch_key, asyncio.Event())
        if self.pool.batch_done(batch_key):  # all in already, or dropped before this call
            event.set()
        try:
            await event.wait()
            return self.pool.take_batch(batch_key)
        finally:
            self._done_events.pop(batch_key, None)
            self._touch()

    async def forget_batch(self, batch_key: str) -> None:
        """The caller gave up on the batch (cancelled, or failed): drop its items and results."""
        self._touch()
        self.pool.forget_batch(batch_key)
        self._wake_batch(batch_key)
        self._notify()

    def _wake_batch(self, batch_key: str) -> None:
        event = self._done_events.get(batch_key)
        if event is not None:
            event.set()

    async def lease(self, worker: str, max_items: int, progress: WorkerProgress | None = None,
                    wait_s: float = 0.0, known_outstanding: int | None = None) -> LeaseReply:
        """Up to ``max_items`` items for ``worker`` and the sequences it should give back; held
        open up to ``wait_s`` seconds (module NOTE) while there are none of either, and while the
        stage's outstanding count is as empty or non-empty as ``known_outstanding`` (the last the
        caller saw; None: any)."""
        self._touch()
        self.num_lease_calls += 1
        pool = self.pool
        called = self.clock()
        deadline = called + min(wait_s, self.max_hold_s)
        if progress is not None:
            self._notify()  # a new load report: other held calls' plans may change
        planned_at = None  # the load reports the last plan saw (``WorkPool.num_reports``)
        try:
            while True:
                now = self.clock()
                pool.hold(worker, max_items, now)
                items = pool.lease(worker, max_items, now, progress)
                progress = None  # recorded: later rounds carry it forward (``plan_give_back``)
                give_back = []
                if planned_at != pool.num_reports:  # a plan changes with the reports (or the clock: below)
                    give_back, planned_at = pool.plan_give_back(worker, now), pool.num_reports
                outstanding = pool.outstanding(now)
                emptiness_changed = known_outstanding is not None and (outstanding == 0) != (known_outstanding == 0)
                if items or give_back or emptiness_changed or worker in self._woken or now >= deadline:
                    break
                next_change = pool.next_change_s(worker, now)
                timeout = deadline - now if next_change is None else min(deadline, next_change) - now
                # Not ``wait_for``: in Python 3.11 it can swallow a cancellation that coincides
                # with the event, and a cancelled caller would then wait on.
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait([changed], timeout=max(timeout, 0.0))
                finally:
                    changed.cancel()
                if not changed.done() or changed.cancelled():  # woken by the clock (a cooldown ended, ...)
                    planned_at = None
                self.num_lease_waits += 1
        finally:
            pool.unhold(worker)
            self._woken.discard(worker)
        if items:
            self._notify()  # fewer pending: others' shares and plans change
        return LeaseReply(
            items=[LeasedItem(i.item_id, i.prompt, i.params, i.owner, i.state, i.movable, i.num_generated)
                   for i in items],
            give_back=give_back,
            num_outstanding=outstanding,
            held_s=self.clock() - called,
        )

    async def wake(self, worker: str) -> None:
        """End ``worker``'s held lease call now (it returns what the pool has for it then); one
        that arrives before that call is held (an async actor may start a caller's calls out of
        order) ends it as soon as it is: at worst the next call returns at once."""
        self._woken.add(worker)
        self._notify()

    async def give_back(self, worker: str, item_id: str, state: Any, num_generated: int,
                        request_id: int | None = None) -> bool:
        """A sequence ``worker`` gave back (``WorkPool.give_back``; ``request_id``: its engine's id
        for it, as the tail plan named it)."""
        self._touch()
        accepted = self.pool.give_back(worker, item_id, state, num_generated, self.clock(), request_id)
        self._slot_freed(worker)
        self._notify()
        return accepted

    async def adopt(self, worker: str, batch_key: str, prompt: Any, params: dict, state: Any, num_generated: int,
                    request_id: int | None = None) -> bool:
        """A row ``worker`` ran outside the pool and gave back as a planned move: the one item of
        its batch ``batch_key`` (``WorkPool.adopt``), which ``worker`` then awaits (``wait_batch``)."""
        self._touch()
        accepted = self.pool.adopt(worker, batch_key, prompt, params, state, num_generated, self.clock(), request_id)
        self._done_events.setdefault(batch_key, asyncio.Event())
        self._slot_freed(worker)
        self._notify()
        return accepted

    async def complete(self, worker: str, item_id: str, result: Any, num_generated: int | None = None) -> bool:
        self._touch()
        recorded = self.pool.complete(worker, item_id, result, num_generated)
        batch_key = item_id.rsplit("/", 1)[0]
        if recorded and self.pool.batch_done(batch_key):
            self._wake_batch(batch_key)
        self._slot_freed(worker)
        self._notify()
        return recorded

    def _slot_freed(self, worker: str) -> None:
        """One of ``worker``'s sequences ended, so its engine has a slot it did not count when
        its held call asked for none: that call returns, and the worker asks again. With no call
        of it held, its next call returns at once: that call may have counted its room from a
        snapshot taken before the sequence ended (async actors start a caller's calls out of
        order, and its engine's snapshot lags a step), and would otherwise hold for its whole
        bound with the slot free (5 s idle in one pair of the skew grid's ``issue-queued``)."""
        if self.pool.holds(worker) in (0, None):
            self._woken.add(worker)

    async def release(self, worker: str, item_ids: list[str]) -> None:
        self._touch()
        self.pool.release(worker, item_ids)
        self._notify()

    async def heartbeat(self, worker: str) -> None:
        self._touch()
        self.pool.heartbeat(worker, self.clock())

    async def counters(self) -> dict:
        """The pool's counters, what it holds now (batches, items, results), and its lease calls."""
        pool = self.pool
        return {**asdict(pool.counters), "num_batches_held": len(pool.batches), "num_items_held": len(pool.items),
                "num_results_held": len(pool.results), "num_lease_calls": self.num_lease_calls,
                "num_lease_waits": self.num_lease_waits}
