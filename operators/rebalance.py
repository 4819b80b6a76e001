"""Cross-actor rebalancing for ``BatchGenOperator``: the actor side of the shared work pool.

NOTE: how one actor takes part.
  * As an owner, ``run_batch`` submits the batch's valid rows to the coordinator and awaits their
    results; it then emits the rows itself (exactly once, in order).
  * As a worker, a background loop leases pool items whenever its engine has room below
    ``max_num_seqs`` (its own batches' items first), runs them, and completes them; heartbeats
    keep its leases alive, and a dead worker's leases expire back into the pool.
  * If the coordinator cannot be reached, the owner runs its batch on its own engine: the job
    completes without rebalancing rather than losing rows.
  * Ray Data shuts an actor down once it has no call in flight and no input is left, so an actor
    leases only while one of its own calls is open, and its last open call stays open while the
    pool still has work for it (the tail is exactly when that matters) and until the items it
    leased are done: an actor is never stopped while holding leases.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
import time
import uuid
from dataclasses import asdict, dataclass

from batchgen_data.async_engine import AsyncEngine, EngineDeadError
from batchgen_data.coordinator import NAMESPACE, coordinator_name, get_or_create_coordinator
from batchgen_data.operators.rows import RowResult
from batchgen_data.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_HEARTBEAT_S = 2.0
_IDLE_POLL_S = 0.05
# How long an actor's last open call waits for more pool work before returning.
_TAIL_GRACE_S = 1.0


@dataclass(slots=True)
class RebalanceStats:
    num_leased: int = 0
    num_run_for_others: int = 0
    num_fallback_batches: int = 0
    idle_s: float = 0.0
    busy_s: float = 0.0


class RebalanceClient:
    def __init__(self, engine: AsyncEngine, stage_key: str, lease_timeout_s: float):
        import ray

        self.engine = engine
        self.worker_id = f"{ray.get_runtime_context().get_actor_id() or 'driver'}-{uuid.uuid4().hex[:6]}"
        self.name = coordinator_name(ray.get_runtime_context().get_job_id(), stage_key)
        self.lease_timeout_s = lease_timeout_s
        self.stats = RebalanceStats()
        self._coordinator = None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._coordinator_ok = True
        self._open_calls = 0
        self._items_in_flight = 0
        self._last_lease_nonempty = 0.0

    def _handle(self):
        if self._coordinator is None:
            self._coordinator = get_or_create_coordinator(self.name, self.lease_timeout_s)
        return self._coordinator

    async def run_batch(self, prompts: list, params: list[SamplingParams]) -> list[RowResult] | None:
        """Results for the batch through the pool; None if the coordinator is unavailable."""
        self._ensure_loop()
        rows = [(p, sp.to_dict()) for p, sp in zip(prompts, params)]
        batch_key = hashlib.sha1(pickle.dumps(rows)).hexdigest()
        self._open_calls += 1
        try:
            coordinator = self._handle()
            await coordinator.submit.remote(batch_key, self.worker_id, rows)
            results = await coordinator.wait_batch.remote(batch_key)
        except Exception as err:  # the coordinator died or is unreachable: run locally
            logger.warning("work pool unavailable (%s); running this batch without rebalancing", err)
            self._coordinator_ok = False
            self.stats.num_fallback_batches += 1
            return None
        finally:
            if self._open_calls == 1:
                await self._drain_leased_items()
            self._open_calls -= 1
        return [RowResult(**r) for r in results]

    async def _drain_leased_items(self) -> None:
        """Hold the actor's last open call while it still has pool work (leased, or leasable
        within ``_TAIL_GRACE_S``); a new call arriving keeps the actor alive instead."""
        deadline = time.monotonic() + _TAIL_GRACE_S
        while self._open_calls == 1 and self._coordinator_ok:
            if self._items_in_flight > 0 or self._last_lease_nonempty > time.monotonic() - _TAIL_GRACE_S:
                deadline = time.monotonic() + _TAIL_GRACE_S
            elif time.monotonic() > deadline:
                return
            await asyncio.sleep(_IDLE_POLL_S)

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._work_loop())

    async def _work_loop(self) -> None:
        last_heartbeat = 0.0
        last = time.monotonic()
        while self._coordinator_ok:
            now = time.monotonic()
            if self.engine.num_unfinished == 0:
                self.stats.idle_s += now - last
            else:
                self.stats.busy_s += now - last
            last = now
            room = self.engine.engine.config.max_num_seqs - self.engine.num_unfinished
            if self._open_calls == 0:
                room = 0  # no call to keep it alive: Ray Data may stop this actor at any moment
            try:
                coordinator = self._handle()
                if now - last_heartbeat > _HEARTBEAT_S:
                    await coordinator.heartbeat.remote(self.worker_id)
                    last_heartbeat = now
                # Ask even with no room while a call is open: it marks this actor active, so the
                # pool saves it a fair share of other owners' rows for when room frees up.
                items = await coordinator.lease.remote(self.worker_id, room) if self._open_calls else []
            except Exception as err:
                logger.warning("work pool unavailable (%s); this actor stops pulling work", err)
                self._coordinator_ok = False
                return
            for item in items:
                self._items_in_flight += 1
                task = asyncio.get_running_loop().create_task(self._run_item(*item))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self.stats.num_leased += len(items)
            if items:
                self._last_lease_nonempty = time.monotonic()
            await asyncio.sleep(0 if items else _IDLE_POLL_S)

    async def _run_item(self, item_id: str, prompt, params: dict) -> None:
        try:
            await self._run_and_complete(item_id, prompt, params)
        finally:
            self._items_in_flight -= 1

    async def _run_and_complete(self, item_id: str, prompt, params: dict) -> None:
        try:
            [out] = await self.engine.generate([prompt], [SamplingParams.from_dict(params)])
        except EngineDeadError:
            # Same rule as the owner path: exit so Ray restarts this actor; the leases it held
            # expire back into the pool and healthy actors redo them.
            logger.critical("batchgen engine died; exiting the actor so Ray restarts it", exc_info=True)
            os._exit(1)
        result = asdict(RowResult.from_output(out))
        try:
            await self._handle().complete.remote(self.worker_id, item_id, result)
        except Exception as err:
            logger.warning("could not report a result to the work pool: %s", err)

    async def counters(self) -> dict:
        import ray

        try:
            handle = ray.get_actor(self.name, namespace=NAMESPACE)
            return await handle.counters.remote()
        except Exception:
            return {}
