"""What both sides of an actor's client share (``ClientState``): its engine, its pool (a transport,
once it has one), what it runs outside the pool, its open calls and leased items, and the event
that marks every change; how its rows' results are made and travel (``ResultCodec``); and what it
does when its engine dies."""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from batchgen_data.engine.async_engine import AsyncEngine
from batchgen_data.errors import EngineDeadError
from batchgen_data.rebalance.client.stats import RebalanceStats
from batchgen_data.rebalance.transport import PoolTransport

logger = logging.getLogger(__name__)


def _identity(value):
    return value


@dataclass(frozen=True, slots=True)
class ResultCodec:
    """A row's result: made from its engine output (``from_output``), and as it travels through
    the pool (``to_wire``: plain, picklable data; ``from_wire`` back). The default keeps the
    engine's ``GenerationOutput``; the Ray Data stage makes its ``RowResult``."""

    from_output: Callable[[Any], Any] = _identity
    to_wire: Callable[[Any], Any] = _identity
    from_wire: Callable[[Any], Any] = _identity


def raise_engine_dead(err: EngineDeadError) -> NoReturn:
    raise err


def kv_bytes(state) -> int:
    kv = getattr(state, "kv", None)
    return 0 if kv is None else kv.numel() * kv.element_size()


def pack(state) -> bytes:
    """A given-back sequence's state as bytes: the coordinator only holds and hands them on, so
    it never unpickles a KV tensor (which would import torch in its process, ~1.5 s of CPU in
    the middle of the job, at the first move)."""
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(slots=True)
class ClientState:
    engine: AsyncEngine
    worker_id: str
    codec: ResultCodec = field(default_factory=ResultCodec)
    # Called with the error when the engine dies (the Ray Data stage exits its actor so Ray
    # restarts it); by default the error is raised to the caller.
    on_engine_dead: Callable[[EngineDeadError], NoReturn] = raise_engine_dead
    stats: RebalanceStats = field(default_factory=RebalanceStats)
    pool: PoolTransport | None = None  # found or started when work would queue
    pool_ok: bool = True  # False once a call to the pool failed: from then on rows run here
    local_rows: int = 0  # rows of this actor's own batches running outside the pool
    local_kv_tokens: int = 0  # ... and their estimated KV tokens at their full lengths
    local_output_tokens: int = 0  # ... and their output budgets (max_tokens + 1)
    open_calls: int = 0  # batch calls of this actor in flight
    max_calls: int | None = None  # the most it runs at once (Ray Data's max_concurrent_calls_per_actor), if known
    items_in_flight: int = 0  # pool items its engine runs
    pool_outstanding: int = 0  # the stage's outstanding items, as its last lease reply said
    holding: int | None = None  # max_items of its lease call held now (None: none)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced at every change

    def notify(self) -> None:
        """Something changed (a call opened, an item ended, a reply came): wake who waits."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def num_taken(self, num_seqs: int) -> int:
        """Running slots its engine's sequences take: ``num_seqs`` by a snapshot, or the rows this
        client handed it (its own outside the pool, and leased items) where those are more: a
        snapshot lags a step behind them."""
        return max(num_seqs, self.local_rows + self.items_in_flight)

    def wake_held_lease(self) -> None:
        """End this actor's held lease call now (not awaited), so its loop asks again with what
        its engine has free now: the pool cannot see rows run outside it end."""
        if self.holding is not None and self.pool_ok and self.pool is not None:
            try:
                self.pool.wake(self.worker_id)
            except Exception as err:
                logger.warning("could not end a held lease call: %s", err)
