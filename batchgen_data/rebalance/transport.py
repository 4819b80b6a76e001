"""How a stage actor's client reaches its stage's coordinator (``coordinator.py``): the calls of
``PoolTransport``, over a Ray actor handle (``RayTransport``, the stage's named coordinator
actor) or a ``Coordinator`` in the caller's own event loop (``InProcessTransport``: one process,
no Ray; what the client's tests and a single-process stage use).

Awaited calls return what the coordinator's method returns; ``register``, ``forget_batch``,
``wake`` and ``release`` are sent without waiting (the client goes on, and the coordinator's
rules cover a lost one: leases expire, an owner that falls silent loses its batches). Either
transport raises what the call raised, or, over Ray, the error of an unreachable actor: the
client then runs its rows itself.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

from batchgen_data.rebalance.coordinator import Coordinator, LeaseReply
from batchgen_data.rebalance.core.progress import WorkerProgress


class PoolTransport(ABC):
    """The coordinator's calls, as a stage actor's client makes them."""

    @abstractmethod
    def register(self, worker: str, ready: bool, load_s: float | None) -> None: ...

    @abstractmethod
    async def submit(self, batch_key: str, owner: str, rows: list[tuple[Any, dict]]) -> None: ...

    @abstractmethod
    async def wait_batch(self, batch_key: str) -> list[Any] | None: ...

    @abstractmethod
    def forget_batch(self, batch_key: str) -> None: ...

    @abstractmethod
    async def lease(self, worker: str, max_items: int, progress: WorkerProgress | None, wait_s: float,
                    known_outstanding: int | None) -> LeaseReply: ...

    @abstractmethod
    def wake(self, worker: str) -> None: ...

    @abstractmethod
    async def give_back(self, worker: str, item_id: str, state: bytes, num_generated: int,
                        request_id: int | None) -> bool: ...

    @abstractmethod
    async def adopt(self, worker: str, batch_key: str, prompt: Any, params: dict, state: bytes,
                    num_generated: int, request_id: int | None) -> bool: ...

    @abstractmethod
    async def complete(self, worker: str, item_id: str, result: Any, num_generated: int | None) -> bool: ...

    @abstractmethod
    def release(self, worker: str, item_ids: list[str]) -> None: ...

    @abstractmethod
    async def counters(self) -> dict: ...


class RayTransport(PoolTransport):
    """Over the coordinator's Ray actor handle (``ray_actor.py``)."""

    def __init__(self, handle):
        self.handle = handle

    def register(self, worker, ready, load_s):
        self.handle.register.remote(worker, ready, load_s)

    async def submit(self, batch_key, owner, rows):
        return await self.handle.submit.remote(batch_key, owner, rows)

    async def wait_batch(self, batch_key):
        return await self.handle.wait_batch.remote(batch_key)

    def forget_batch(self, batch_key):
        self.handle.forget_batch.remote(batch_key)

    async def lease(self, worker, max_items, progress, wait_s, known_outstanding):
        return await self.handle.lease.remote(worker, max_items, progress, wait_s, known_outstanding)

    def wake(self, worker):
        self.handle.wake.remote(worker)

    async def give_back(self, worker, item_id, state, num_generated, request_id):
        return await self.handle.give_back.remote(worker, item_id, state, num_generated, request_id)

    async def adopt(self, worker, batch_key, prompt, params, state, num_generated, request_id):
        return await self.handle.adopt.remote(worker, batch_key, prompt, params, state, num_generated, request_id)

    async def complete(self, worker, item_id, result, num_generated):
        return await self.handle.complete.remote(worker, item_id, result, num_generated)

    def release(self, worker, item_ids):
        self.handle.release.remote(worker, item_ids)

    async def counters(self):
        return await self.handle.counters.remote()


class InProcessTransport(PoolTransport):
    """Over a ``Coordinator`` in the caller's running event loop: each call runs as a task of that
    loop, as a Ray actor call runs in the actor's, so a call the caller stops awaiting still
    completes (calls that are not awaited need a running loop)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    def _send(self, call) -> asyncio.Future:
        return asyncio.ensure_future(call)

    async def _call(self, call):
        return await asyncio.shield(self._send(call))

    def register(self, worker, ready, load_s):
        self._send(self.coordinator.register(worker, ready, load_s))

    async def submit(self, batch_key, owner, rows):
        return await self._call(self.coordinator.submit(batch_key, owner, rows))

    async def wait_batch(self, batch_key):
        return await self._call(self.coordinator.wait_batch(batch_key))

    def forget_batch(self, batch_key):
        self._send(self.coordinator.forget_batch(batch_key))

    async def lease(self, worker, max_items, progress, wait_s, known_outstanding):
        return await self._call(self.coordinator.lease(worker, max_items, progress, wait_s, known_outstanding))

    def wake(self, worker):
        self._send(self.coordinator.wake(worker))

    async def give_back(self, worker, item_id, state, num_generated, request_id):
        return await self._call(self.coordinator.give_back(worker, item_id, state, num_generated, request_id))

    async def adopt(self, worker, batch_key, prompt, params, state, num_generated, request_id):
        return await self._call(self.coordinator.adopt(worker, batch_key, prompt, params, state, num_generated,
                                                       request_id))

    async def complete(self, worker, item_id, result, num_generated):
        return await self._call(self.coordinator.complete(worker, item_id, result, num_generated))

    def release(self, worker, item_ids):
        self._send(self.coordinator.release(worker, item_ids))

    async def counters(self):
        return await self._call(self.coordinator.counters())
