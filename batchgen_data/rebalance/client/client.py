"""An actor's part in its stage's work pool (``RebalanceClient``): the owner side (its batch calls:
rows on its own engine while the stage needs no pool, through the pool once it has one, rows
adopted as they move), over the state it shares with its worker side (``lease_loop.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NoReturn

from batchgen_data.engine.async_engine import AsyncEngine, MigratedOut
from batchgen_data.engine.migration.calibration_cache import load_or_calibrate
from batchgen_data.engine.migration.engine_probe import EngineProbe
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.errors import EngineDeadError
from batchgen_data.paths import cache_dir
from batchgen_data.rebalance.client.lease_loop import LeaseLoop
from batchgen_data.rebalance.client.membership import PoolMembership, new_worker_id, stage_coordinator_name
from batchgen_data.rebalance.client.state import ClientState, ResultCodec, kv_bytes, pack, raise_engine_dead
from batchgen_data.rebalance.core.local_first import EngineRoom, full_length, rows_here
from batchgen_data.rebalance.ray_actor import find_pool, start_pool
from batchgen_data.rebalance.transport import PoolTransport

logger = logging.getLogger(__name__)

# How often an actor running rows outside the pool looks for the pool another actor started (a
# Ray named-actor lookup, ~1 ms): it joins within this of the pool's start, and its rows move.
_FIND_EVERY_S = 1.0


class RebalanceClient:
    """One actor's part in the stage's work pool (``client/__init__.py``'s NOTE).

    Args:
        engine (AsyncEngine): the actor's engine, before its first request.
        stage_key (str): names the stage's coordinator (the stage's config).
        lease_timeout_s (float): how long a silent worker keeps its leases.
        coordinator (PoolMembership | PoolTransport | None): from ``join_stage`` (its worker id
            and start time), a transport to the stage's coordinator (``rebalance/transport.py``:
            this client joins it now), or None: the stage's coordinator is found or started on
            demand (``run_batch``, ``ray_actor.find_pool`` / ``start_pool``).
        calibrate (bool, default True): calibrate the engine's step model now (~0.2 s on the
            demo model); without it the move rule splits no running set until the engine's own
            steps show a slope.
        codec (ResultCodec): a row's result from its output, and as it travels (default: the
            engine's ``GenerationOutput``).
        on_engine_dead: called with the error when the engine dies (default: raise it).
        max_calls (int | None): the most batch calls its actor runs at once (Ray Data's
            ``max_concurrent_calls_per_actor``), if known: with its open calls in each load
            report, it tells the pool when the stage's input is all in (``core/pacing.py``).
    """

    def __init__(self, engine: AsyncEngine, stage_key: str, lease_timeout_s: float, coordinator=None,
                 calibrate: bool = True, codec: ResultCodec | None = None,
                 on_engine_dead: Callable[[EngineDeadError], NoReturn] = raise_engine_dead,
                 max_calls: int | None = None):
        self.engine = engine
        self.name = stage_coordinator_name(stage_key)
        self.lease_timeout_s = lease_timeout_s
        started = None  # when the actor started, if known: the pool learns how long actors take to load
        if isinstance(coordinator, PoolMembership):
            worker_id, coordinator, started = coordinator.worker_id, coordinator.coordinator, coordinator.started
        else:
            worker_id = new_worker_id()
        self.state = ClientState(engine, worker_id, codec or ResultCodec(), on_engine_dead, max_calls=max_calls)
        self.stats = self.state.stats
        self.probe = EngineProbe.attach(engine)  # its engine's load, published by the engine thread
        self.worker = LeaseLoop(self.state, self.probe)
        self._watch_task: asyncio.Task | None = None  # ``_watch_for_pool``, while rows run here without a pool
        if calibrate:
            self._calibrate()
        self._load_s = None if started is None else time.monotonic() - started
        self.stats.ready_wall = time.time()
        if coordinator is not None:
            self._join(coordinator)

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    def background_tasks(self) -> list[asyncio.Task]:
        """Its lease loop, the items it runs and its pool watch (for a test to stop them)."""
        return [t for t in (self.worker._task, *self.worker._tasks, self._watch_task) if t is not None]

    def _calibrate(self) -> None:
        """The engine's step model from a few timed decode steps (before its thread starts), or
        from an earlier engine's on this machine with the same model and settings."""
        calibration = load_or_calibrate(self.engine.engine, cache_dir() / "step-models")
        self.stats.calibration_s = calibration.seconds
        self.stats.calibration_cached = calibration.cached
        if calibration.model is not None:
            self.probe.calibrate(calibration.model)
            self.stats.calibrated_base_s = calibration.model.base_s
            self.stats.calibrated_per_seq_s = calibration.model.per_seq_s

    def _join(self, pool: PoolTransport) -> None:
        """Take part in the stage's pool from now on: register (ready, with the time this actor
        took to load); the lease loop starts at its next call."""
        self.state.pool = pool
        self.state.pool_outstanding = 1  # not known yet: the loop's first lease call says
        self.stats.joined_pool_wall = time.time()
        try:
            pool.register(self.worker_id, True, self._load_s)
        except Exception as err:  # its first lease registers it as a worker anyway
            logger.warning("could not register with the work pool: %s", err)

    def _find(self) -> PoolTransport | None:
        """The stage's pool if some actor of the stage started it (looked up by name, once per
        call until found); None while none did."""
        if self.state.pool is None and self.state.pool_ok:
            pool = find_pool(self.name)
            if pool is not None:
                self._join(pool)
        if self.state.pool is not None:
            self.worker.ensure_running()
        return self.state.pool

    def _start_pool(self) -> PoolTransport:
        """Start the stage's pool (or find the one another actor just started)."""
        if self.state.pool is None:
            self._join(start_pool(self.name, self.lease_timeout_s))
        self.worker.ensure_running()
        return self.state.pool

    async def run_batch(self, prompts: list, params: list[SamplingParams]) -> list[Any] | None:
        """Results for the batch: on this actor's engine while no pool is needed, else through
        the pool; None if the pool cannot give them (the coordinator is unavailable, or it
        dropped the batch): the caller runs them locally.

        The pool starts on demand: while no actor of the stage has rows that would queue, every
        batch runs on its own actor's engine, with no coordinator process and no round trip. A
        batch with more rows than its engine has free running slots starts the pool (or finds
        it): the longest rows that fit start here at once, the rest go to the pool, where this
        actor leases them back as its slots free unless an actor with room takes them first.
        Once the pool exists every batch goes through it, and an actor whose last call ends
        while the pool has work holds that call to help (``LeaseLoop.drain``)."""
        state = self.state
        self.stats.first_call_wall = self.stats.first_call_wall or time.time()
        if not state.pool_ok:  # its pool failed earlier: the caller runs the batch
            self.stats.num_fallback_batches += 1
            return None
        state.open_calls += 1
        state.notify()
        try:
            if self._find() is None:
                lengths = [full_length(p, sp.max_tokens) for p, sp in zip(prompts, params)]
                here = rows_here(lengths, self._room_now())
                if len(here) == len(prompts):
                    self.stats.num_local_batches += 1
                    return await self._run_local(prompts, params, lengths)
                pooled = sorted(set(range(len(prompts))) - set(here))
                local = self._run_local([prompts[i] for i in here], [params[i] for i in here],
                                        [lengths[i] for i in here])
                self._start_pool()
                try:
                    rest = await self._run_pooled([prompts[i] for i in pooled], [params[i] for i in pooled])
                    if rest is None:
                        rest = await self._run_local([prompts[i] for i in pooled], [params[i] for i in pooled],
                                                     [lengths[i] for i in pooled])
                    mine = await local
                except BaseException:  # cancelled or failed: its rows here stop too
                    local.cancel()
                    await asyncio.gather(local, return_exceptions=True)
                    raise
                by_index = dict(zip(here, mine)) | dict(zip(pooled, rest))
                return [by_index[i] for i in range(len(prompts))]
            return await self._run_pooled(prompts, params)
        finally:
            if state.open_calls == 1 and self._find() is not None:
                await self.worker.drain()
            state.open_calls -= 1
            if not state.open_calls:  # its last call closed: the pool stops counting it as taking work
                state.wake_held_lease()

    def _room_now(self) -> EngineRoom:
        """What this actor's engine has free for rows that should start now: by its last
        snapshot, or by what this client handed it since where that claims more."""
        seqs = self.probe.snapshot.progress.seqs
        engine = self.engine.engine
        slots = engine.max_running_seqs - self.state.num_taken(len(seqs))
        claimed = max(sum(s.num_tokens + s.num_tokens_left for s in seqs), self.state.local_kv_tokens)
        return EngineRoom(max(0, slots), max(0, engine.kv_capacity_tokens - claimed))

    def _run_local(self, prompts: list, params: list[SamplingParams], lengths: list[int]) -> asyncio.Future:
        """Rows on this actor's engine, outside the pool; ``lengths``, their estimated KV tokens at
        the end (``local_first.full_length``). They count against its room from this call on (its
        lease loop must not fill their slots) until each ends or moves away: once the stage has a
        pool they are movable, and one a tail plan names enters the pool as it moves
        (``_adopted``). While they run without a pool, the actor looks for one another actor
        started (``_watch_for_pool``), so it joins without waiting for its next call."""
        if self.state.pool is None and self._watch_task is None and self.state.pool_ok:
            self._watch_task = asyncio.ensure_future(self._watch_for_pool())
        return asyncio.ensure_future(asyncio.gather(*(self._run_local_row(p, sp, n)
                                                      for p, sp, n in zip(prompts, params, lengths))))

    async def _watch_for_pool(self) -> None:
        """Look for the stage's pool every ``_FIND_EVERY_S`` while rows run here without one."""
        state = self.state
        try:
            await asyncio.sleep(_FIND_EVERY_S)
            while state.pool is None and state.pool_ok and state.local_rows:
                self._find()
                await asyncio.sleep(_FIND_EVERY_S)
        finally:
            self._watch_task = None

    async def _run_local_row(self, prompt, params: SamplingParams, length: int):
        state = self.state
        output_tokens = params.max_tokens + 1
        state.local_rows += 1
        state.local_kv_tokens += length
        state.local_output_tokens += output_tokens
        try:
            out = await self.engine.run_one(prompt, params, movable=True, in_pool=False)
        except EngineDeadError as err:
            state.on_engine_dead(err)
        finally:
            state.local_rows -= 1
            state.local_kv_tokens -= length
            state.local_output_tokens -= output_tokens
            state.wake_held_lease()  # its slot is free: a call held for want of room asks again
        if isinstance(out, MigratedOut):  # a tail plan moved it: the pool hands it on
            return await self._adopted(prompt, params, out.state)
        return state.codec.from_output(out)

    async def _adopted(self, prompt, params: SamplingParams, moved):
        """A row of this actor's, run outside the pool and exported by a planned move: into the
        pool as a batch of its own (``WorkPool.adopt``), and its result awaited as a pooled
        batch's. If the pool cannot give it, it goes on here from its exported state."""
        state = self.state
        self.stats.migrated_out_bytes += kv_bytes(moved)
        results = await self._through_pool(lambda key: state.pool.adopt(
            self.worker_id, key, prompt, params.to_dict(), pack(moved), len(moved.output_token_ids), moved.request_id))
        if results is not None:
            self.stats.num_adopted += 1
            return state.codec.from_wire(results[0])
        try:
            out = await self.engine.run_one(prompt, params, state=moved, movable=False, in_pool=False)
        except EngineDeadError as err:
            state.on_engine_dead(err)
        return state.codec.from_output(out)

    async def _run_pooled(self, prompts: list, params: list[SamplingParams]) -> list[Any] | None:
        """Rows through the pool: submitted under a key of this call's own (equal rows in
        another call, a copy of the batch or a retry, are another batch, and unseeded sampled
        rows get their own samples), then awaited; None if the pool cannot give them."""
        rows = [(p, sp.to_dict()) for p, sp in zip(prompts, params)]
        results = await self._through_pool(lambda key: self.state.pool.submit(key, self.worker_id, rows))
        return None if results is None else [self.state.codec.from_wire(r) for r in results]

    async def _through_pool(self, send) -> list[Any] | None:
        """A batch of this actor's into the pool (``send(batch_key)``: submit, or adopt) under a
        key of its own, and its results awaited; None if the pool cannot give them (the caller
        runs the rows here)."""
        state = self.state
        batch_key = f"{self.worker_id}/{uuid.uuid4().hex}"
        results = None
        try:
            await send(batch_key)
            results = await state.pool.wait_batch(batch_key)
        except Exception as err:  # the coordinator died or is unreachable: run locally
            logger.warning("work pool unavailable (%s); running these rows without rebalancing", err)
            state.pool_ok = False
        finally:
            if results is None:  # cancelled, failed or dropped: nobody will take its results
                self._forget_batch(batch_key)
        if results is None:
            self.stats.num_fallback_batches += 1
        return results

    def _forget_batch(self, batch_key: str) -> None:
        """Tell the pool to drop a batch this actor no longer waits for (not awaited: a
        cancelled call cannot wait, and the owner-silence rule covers a lost message)."""
        try:
            self.state.pool.forget_batch(batch_key)
        except Exception as err:
            logger.warning("could not tell the work pool to drop a batch: %s", err)

    def snapshot(self) -> dict:
        """This actor's counters, with the KV tokens its engine recomputed."""
        self.stats.num_recomputed_tokens = self.engine.engine.stats().num_recomputed_tokens
        return asdict(self.stats)

    async def counters(self) -> dict:
        """The stage's pool counters (``Coordinator.counters``); {} if it has no pool."""
        try:
            pool = self.state.pool or find_pool(self.name)
            return {} if pool is None else await pool.counters()
        except Exception:
            return {}
