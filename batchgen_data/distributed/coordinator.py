"""The per-stage coordinator: a Ray actor holding the shared ``WorkPool``.

The first operator actor creates it by name (detached, no CPUs) and the others find it by the
same name. It is not a single point of data loss: owners keep their own rows and fall back to
running them locally when the coordinator cannot be reached (see ``operators/rebalance.py``).
It exits by itself once idle with nothing outstanding.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen_data.distributed.work_pool import WorkPool
from batchgen_data.engine.migration.planner import Move, WorkerProgress

NAMESPACE = "batchgen"


@dataclass(slots=True)
class LeasedItem:
    item_id: str
    prompt: Any
    params: dict  # SamplingParams fields
    owner: str = ""
    state: bytes | None = None  # a pickled SequenceState to continue, when given back mid-generation
    movable: bool = True  # may be given back again at the tail


@dataclass(slots=True)
class LeaseReply:
    items: list[LeasedItem] = field(default_factory=list)
    give_back: list[Move] = field(default_factory=list)  # PARTITION: export exactly these (``plan_moves``)
    num_outstanding: int = 0  # pending plus leased items of the whole stage


class Coordinator:
    """Actor body (wrapped with ``ray.remote`` by ``get_or_create_coordinator``)."""

    def __init__(self, lease_timeout_s: float = 30.0, idle_exit_s: float = 300.0):
        self.pool = WorkPool(lease_timeout_s)
        self.idle_exit_s = idle_exit_s
        self._last_call = time.monotonic()
        self._done_events: dict[str, asyncio.Event] = {}
        self._watchdog: asyncio.Task | None = None

    def _touch(self) -> None:
        self._last_call = time.monotonic()
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._exit_when_idle())

    async def _exit_when_idle(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, self.idle_exit_s))
            idle = time.monotonic() - self._last_call
            if idle > self.idle_exit_s and self.pool.num_outstanding == 0:
                os._exit(0)  # detached: nobody else ends it

    async def submit(self, batch_key: str, owner: str, rows: list[tuple[Any, dict]]) -> None:
        self._touch()
        self.pool.submit(batch_key, owner, rows, time.monotonic())
        self._done_events.setdefault(batch_key, asyncio.Event())
        if self.pool.batch_done(batch_key):
            self._done_events[batch_key].set()

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
        self._wake(batch_key)

    def _wake(self, batch_key: str) -> None:
        event = self._done_events.get(batch_key)
        if event is not None:
            event.set()

    async def lease(self, worker: str, max_items: int, progress: WorkerProgress | None = None) -> LeaseReply:
        self._touch()
        now = time.monotonic()
        for batch_key in self.pool.drop_orphaned_batches(now):
            self._wake(batch_key)
        items = self.pool.lease(worker, max_items, now, progress)
        return LeaseReply(
            items=[LeasedItem(i.item_id, i.prompt, i.params, i.owner, i.state, i.movable) for i in items],
            give_back=self.pool.plan_give_back(worker, now),
            num_outstanding=self.pool.num_outstanding,
        )

    async def give_back(self, worker: str, item_id: str, state: Any, num_generated: int) -> bool:
        self._touch()
        return self.pool.give_back(worker, item_id, state, num_generated, time.monotonic())

    async def complete(self, worker: str, item_id: str, result: Any, num_generated: int | None = None) -> bool:
        self._touch()
        recorded = self.pool.complete(worker, item_id, result, num_generated)
        batch_key = item_id.rsplit("/", 1)[0]
        if recorded and self.pool.batch_done(batch_key):
            self._wake(batch_key)
        return recorded

    async def release(self, worker: str, item_ids: list[str]) -> None:
        self._touch()
        self.pool.release(worker, item_ids)

    async def heartbeat(self, worker: str) -> None:
        self._touch()
        self.pool.heartbeat(worker, time.monotonic())

    async def counters(self) -> dict:
        """The pool's counters, and what it holds now (batches, items, results)."""
        pool = self.pool
        return {**asdict(pool.counters), "num_batches_held": len(pool.batches), "num_items_held": len(pool.items),
                "num_results_held": len(pool.results)}


def coordinator_name(job_id: str, stage_key: str) -> str:
    digest = hashlib.sha1(stage_key.encode()).hexdigest()[:12]
    return f"batchgen-pool-{job_id}-{digest}"


def get_or_create_coordinator(name: str, lease_timeout_s: float):
    import ray

    actor_cls = ray.remote(Coordinator)
    return actor_cls.options(
        name=name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",  # must outlive the operator actor that happened to create it
        num_cpus=0,
        max_concurrency=10_000,
    ).remote(lease_timeout_s=lease_timeout_s)
