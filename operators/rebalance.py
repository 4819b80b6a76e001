"""Cross-actor rebalancing for ``BatchGenOperator``: the actor side of the shared work pool.

NOTE: how one actor takes part.
  * The pool starts on demand (``run_batch``): while the stage has none, a batch whose rows fit
    the engine's free running slots and KV memory runs on the actor's own engine
    (``local_first.rows_here``), with no coordinator process and no round trip; a batch with
    rows that would queue starts the stage's coordinator (or finds it), starts the longest rows
    that fit at once and puts the rest in the pool. Once the pool exists every batch goes
    through it, and every actor joins it (registers, with how long it took to load) at its next
    call. Once its engine is built, the client calibrates the engine's step model
    (``migration/calibration.py``: a few dummy decode steps at 2 and at a full running set, ~0.2
    s on the demo model, once per machine, model and settings: later engines read it from disk,
    ``calibration_cache.py``).
  * As an owner, ``run_batch`` submits the batch's valid rows to the coordinator and awaits their
    results; it then emits the rows itself (exactly once, in order). Rows it ran outside the
    pool are movable once the stage has a pool: one a tail plan names enters the pool as it moves
    (``WorkPool.adopt``, a batch of its own), and the owner awaits its result as a pooled one.
  * As a worker, a background loop leases pool items for the running slots its engine has free
    below ``max_num_seqs``, or about to free (a sequence that reaches its ``max_tokens`` within
    one measured lease round trip), the longest first, its own batches' among equals; runs
    them, and completes them. Leases come on events, not on a timer: the coordinator holds a
    lease call that gets nothing open until the pool has something for this actor (items, a
    give-back, the stage's pool emptied) or its wait bound, so an actor with room and nothing to
    take waits in one call; an engine with no room holds its call until its next slot is about
    to free, and a sequence that ends sooner (its result, or its give-back, reaching the
    coordinator) ends that call. A held call keeps the actor's leases alive, and a dead
    worker's leases expire back into the pool. No prefetch beyond that: a row leased ahead
    waits in that engine until one of its slots frees (with long rows running, a whole long
    sequence) while another actor could start it now, and prefetched rows refill freed slots
    before the actor ever reports them empty, so the pool's longest-first rule never gets to
    place long rows there (on the clustered skew workload, ~700 steps per actor instead of the
    560 of perfect packing). Each lease call carries the actor's load report
    (``WorkerProgress``: its engine's sequences from one snapshot, its step model, what a move
    costs).
  * If the coordinator cannot be reached, the owner runs its batch on its own engine: the job
    completes without rebalancing rather than losing rows.
  * At the tail (nothing pending), the pool names the sequences a worker should give back, by
    the engine's one move rule (``batchgen_data/engine/migration/planner.py``: the moves must pay
    for themselves, net of their cost), each with whether its KV travels (PARTITION of the
    straggler set). Its engine exports exactly those (``AsyncEngine.migrate_out``); the state
    travels through the coordinator as pickled bytes, and the receiver leases and continues it
    (MIGRATE). A given-back item is an ordinary pending item with a state attached, so leases,
    expiry and first-result-wins cover it unchanged.
  * Each call submits its rows under a key of its own, so two equal batches (unseeded sampled
    rows) get their own samples; a call that ends without its results (cancelled, failed) tells
    the pool to drop the batch, and the pool drops the batches of an owner it no longer hears
    from: nothing waits in it for a caller that is gone.
  * Ray Data shuts an actor down once it has no call in flight and no input is left, so an actor
    leases only while one of its own calls is open (items a held lease brings after its last
    call closed go straight back), and its last open call stays open while the stage still has
    outstanding work (which may come to it at the tail) and until the items it leased are done:
    an actor is never stopped while holding leases. A new call arriving releases the held one.
    With ``max_concurrent_calls_per_actor=1`` no new call can arrive, so batches advance in
    rounds (an actor done with its batch helps the others finish theirs before it takes the
    next); with two or more calls per actor, as the operator's in-flight warning asks for, there
    is no such barrier.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from collections import deque
from dataclasses import asdict
from itertools import islice

from batchgen_data.operators.columns import RowResult
from batchgen_data.operators.pool_membership import (
    PoolMembership,
    engine_compute,
    new_worker_id,
    stage_coordinator_name,
)
from batchgen_data.operators.rebalance_stats import RebalanceStats
from batchgen_data.operators.restart import exit_for_restart

from batchgen_data.engine.async_engine import AsyncEngine, MigratedOut
from batchgen_data.engine.migration.calibration_cache import load_or_calibrate
from batchgen_data.engine.migration.costs import MigrationCosts
from batchgen_data.engine.migration.engine_probe import EngineProbe
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.errors import EngineDeadError
from batchgen_data.paths import cache_dir
from batchgen_data.rebalance.coordinator import LeasedItem, LeaseReply
from batchgen_data.rebalance.core.local_first import EngineRoom, full_length, rows_here
from batchgen_data.rebalance.core.move_rule import Move
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.worker_room import slots_freeing_soon
from batchgen_data.rebalance.ray_actor import find_pool, start_pool
from batchgen_data.rebalance.transport import PoolTransport

logger = logging.getLogger(__name__)

# Items handed to the engine and not accepted yet are at most one lease reply's (the engine
# thread takes everything queued before its next step); remembered for the load report.
_MAX_INCOMING = 4096
# The longest a lease call is held open with nothing for this actor (the coordinator caps it at a
# third of the lease timeout): an idle actor makes one call per this long.
_MAX_HOLD_S = 5.0
# How often an actor running rows outside the pool looks for the pool another actor started (a
# Ray named-actor lookup, ~1 ms): it joins within this of the pool's start, and its rows move.
_FIND_EVERY_S = 1.0


def _kv_bytes(state) -> int:
    kv = getattr(state, "kv", None)
    return 0 if kv is None else kv.numel() * kv.element_size()


def _pack(state) -> bytes:
    """A given-back sequence's state as bytes: the coordinator only holds and hands them on, so
    it never unpickles a KV tensor (which would import torch in its process, ~1.5 s of CPU in
    the middle of the job, at the first move)."""
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


class RebalanceClient:
    """One actor's part in the stage's work pool (module NOTE).

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
    """

    def __init__(self, engine: AsyncEngine, stage_key: str, lease_timeout_s: float, coordinator=None,
                 calibrate: bool = True):
        self.engine = engine
        self.name = stage_coordinator_name(stage_key)
        self.lease_timeout_s = lease_timeout_s
        self.stats = RebalanceStats()
        started = None  # when the actor started, if known: the pool learns how long actors take to load
        if isinstance(coordinator, PoolMembership):
            self.worker_id, coordinator, started = coordinator.worker_id, coordinator.coordinator, coordinator.started
        else:
            self.worker_id = new_worker_id()
        self._coordinator: PoolTransport | None = None  # found or started when work would queue (``_find``, ``_start_pool``)
        self._local_rows = 0  # rows of this actor's own batches running outside the pool
        self._local_kv_tokens = 0  # ... and their estimated KV tokens at their full lengths
        self._local_output_tokens = 0  # ... and their output budgets (max_tokens)
        self._loop_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None  # ``_watch_for_pool``, while rows run here without a pool
        self._compute = None  # ``engine_compute``, found at the first load report
        self._tasks: set[asyncio.Task] = set()
        self._coordinator_ok = True
        self._open_calls = 0
        self._items_in_flight = 0
        self._pool_outstanding = 0
        self._changed = asyncio.Event()  # replaced at every change: a call opened, an item ended, a reply
        self._holding: int | None = None  # max_items of the lease call held now (None: none)
        self._num_submitted = 0  # items handed to the engine so far (leased and started)
        # The latest of them, as the waiting sequences they are until the engine accepts them
        # (submissions are accepted in order: the last ``submitted - accepted`` are on their way).
        self._submitted: deque[SeqProgress] = deque(maxlen=_MAX_INCOMING)
        self._call_s = 0.005  # lease round trip, moving average (measured, the held time left out)
        self._step_s_hint = 0.05  # the engine's step at its current running set (measured)
        self._kv_s_per_token = MigrationCosts.of_engine(engine.engine).transfer_s(1)  # KV shipped per token
        self.probe = EngineProbe.attach(engine)  # its engine's load, published by the engine thread
        if calibrate:
            self._calibrate()
        self._load_s = None if started is None else time.monotonic() - started
        self.stats.ready_wall = time.time()
        if coordinator is not None:
            self._join(coordinator)

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

    def _join(self, coordinator: PoolTransport) -> None:
        """Take part in the stage's pool from now on: register (ready, with the time this actor
        took to load) and start the lease loop."""
        self._coordinator = coordinator
        self._pool_outstanding = 1  # not known yet: the loop's first lease call says
        self.stats.joined_pool_wall = time.time()
        try:
            coordinator.register(self.worker_id, True, self._load_s)
        except Exception as err:  # its first lease registers it as a worker anyway
            logger.warning("could not register with the work pool: %s", err)

    def _find(self):
        """The stage's coordinator if some actor of the stage started it (looked up by name, once
        per call until found); None while none did."""
        if self._coordinator is None and self._coordinator_ok:
            coordinator = find_pool(self.name)
            if coordinator is not None:
                self._join(coordinator)
        if self._coordinator is not None:
            self._ensure_loop()
        return self._coordinator

    def _start_pool(self):
        """Start the stage's coordinator (or find the one another actor just started)."""
        if self._coordinator is None:
            self._join(start_pool(self.name, self.lease_timeout_s))
        self._ensure_loop()
        return self._coordinator

    def _handle(self) -> PoolTransport:
        return self._coordinator

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def run_batch(self, prompts: list, params: list[SamplingParams]) -> list[RowResult] | None:
        """Results for the batch: on this actor's engine while no pool is needed, else through
        the pool; None if the pool cannot give them (the coordinator is unavailable, or it
        dropped the batch): the caller runs them locally.

        The pool starts on demand: while no actor of the stage has rows that would queue, every
        batch runs on its own actor's engine, with no coordinator process and no round trip. A
        batch with more rows than its engine has free running slots starts the pool (or finds
        it): the longest rows that fit start here at once, the rest go to the pool, where this
        actor leases them back as its slots free unless an actor with room takes them first.
        Once the pool exists every batch goes through it, and an actor whose last call ends
        while the pool has work holds that call to help (``_drain_leased_items``)."""
        self.stats.first_call_wall = self.stats.first_call_wall or time.time()
        if not self._coordinator_ok:  # its pool failed earlier: the caller runs the batch
            self.stats.num_fallback_batches += 1
            return None
        self._open_calls += 1
        self._notify()
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
            if self._open_calls == 1 and self._find() is not None:
                await self._drain_leased_items()
            self._open_calls -= 1
            if not self._open_calls:  # its last call closed: the pool stops counting it as taking work
                self._wake_held_lease()

    def _room_now(self) -> EngineRoom:
        """What this actor's engine has free for rows that should start now: by its last
        snapshot, or by what this client handed it since where that claims more."""
        seqs = self.probe.snapshot.progress.seqs
        engine = self.engine.engine
        slots = engine.max_running_seqs - self._num_taken(len(seqs))
        claimed = max(sum(s.num_tokens + s.num_tokens_left for s in seqs), self._local_kv_tokens)
        return EngineRoom(max(0, slots), max(0, engine.kv_capacity_tokens - claimed))

    def _num_taken(self, num_seqs: int) -> int:
        """Running slots its engine's sequences take: ``num_seqs`` by a snapshot, or the rows this
        client handed it (its own outside the pool, and leased items) where those are more: a
        snapshot lags a step behind them."""
        return max(num_seqs, self._local_rows + self._items_in_flight)

    def _run_local(self, prompts: list, params: list[SamplingParams], lengths: list[int]) -> asyncio.Future:
        """Rows on this actor's engine, outside the pool; ``lengths``, their estimated KV tokens at
        the end (``local_first.full_length``). They count against its room from this call on (its
        lease loop must not fill their slots) until each ends or moves away: once the stage has a
        pool they are movable, and one a tail plan names enters the pool as it moves
        (``_adopted``). While they run without a pool, the actor looks for one another actor
        started (``_watch_for_pool``), so it joins without waiting for its next call."""
        if self._coordinator is None and self._watch_task is None and self._coordinator_ok:
            self._watch_task = asyncio.ensure_future(self._watch_for_pool())
        return asyncio.ensure_future(asyncio.gather(*(self._run_local_row(p, sp, n)
                                                      for p, sp, n in zip(prompts, params, lengths))))

    async def _watch_for_pool(self) -> None:
        """Look for the stage's pool every ``_FIND_EVERY_S`` while rows run here without one."""
        try:
            await asyncio.sleep(_FIND_EVERY_S)
            while self._coordinator is None and self._coordinator_ok and self._local_rows:
                self._find()
                await asyncio.sleep(_FIND_EVERY_S)
        finally:
            self._watch_task = None

    async def _run_local_row(self, prompt, params: SamplingParams, length: int) -> RowResult:
        output_tokens = params.max_tokens + 1
        self._local_rows += 1
        self._local_kv_tokens += length
        self._local_output_tokens += output_tokens
        try:
            out = await self.engine.run_one(prompt, params, movable=True, in_pool=False)
        except EngineDeadError as err:
            exit_for_restart(err)
        finally:
            self._local_rows -= 1
            self._local_kv_tokens -= length
            self._local_output_tokens -= output_tokens
            self._wake_held_lease()  # its slot is free: a call held for want of room asks again
        if isinstance(out, MigratedOut):  # a tail plan moved it: the pool hands it on
            return await self._adopted(prompt, params, out.state)
        return RowResult.from_output(out)

    async def _adopted(self, prompt, params: SamplingParams, state) -> RowResult:
        """A row of this actor's, run outside the pool and exported by a planned move: into the
        pool as a batch of its own (``WorkPool.adopt``), and its result awaited as a pooled
        batch's. If the pool cannot give it, it goes on here from its exported state."""
        self.stats.migrated_out_bytes += _kv_bytes(state)
        batch_key = f"{self.worker_id}/{uuid.uuid4().hex}"
        results = None
        try:
            coordinator = self._handle()
            await coordinator.adopt(self.worker_id, batch_key, prompt, params.to_dict(), _pack(state),
                                           len(state.output_token_ids), state.request_id)
            results = await coordinator.wait_batch(batch_key)
        except Exception as err:
            logger.warning("work pool unavailable (%s); running a moved row here", err)
            self._coordinator_ok = False
        finally:
            if results is None:
                self._forget_batch(batch_key)
        if results is not None:
            self.stats.num_adopted += 1
            return RowResult(**results[0])
        self.stats.num_fallback_batches += 1
        try:
            out = await self.engine.run_one(prompt, params, state=state, movable=False, in_pool=False)
        except EngineDeadError as err:
            exit_for_restart(err)
        return RowResult.from_output(out)

    async def _run_pooled(self, prompts: list, params: list[SamplingParams]) -> list[RowResult] | None:
        """Rows through the pool: submitted under a key of this call's own (equal rows in
        another call, a copy of the batch or a retry, are another batch, and unseeded sampled
        rows get their own samples), then awaited; None if the pool cannot give them."""
        rows = [(p, sp.to_dict()) for p, sp in zip(prompts, params)]
        batch_key = f"{self.worker_id}/{uuid.uuid4().hex}"
        results = None
        try:
            coordinator = self._handle()
            await coordinator.submit(batch_key, self.worker_id, rows)
            results = await coordinator.wait_batch(batch_key)
        except Exception as err:  # the coordinator died or is unreachable: run locally
            logger.warning("work pool unavailable (%s); running this batch without rebalancing", err)
            self._coordinator_ok = False
        finally:
            if results is None:  # cancelled, failed or dropped: nobody will take its results
                self._forget_batch(batch_key)
        if results is None:
            self.stats.num_fallback_batches += 1
            return None
        return [RowResult(**r) for r in results]

    def _forget_batch(self, batch_key: str) -> None:
        """Tell the pool to drop a batch this actor no longer waits for (not awaited: a
        cancelled call cannot wait, and the owner-silence rule covers a lost message)."""
        try:
            self._handle().forget_batch(batch_key)
        except Exception as err:
            logger.warning("could not tell the work pool to drop a batch: %s", err)

    def _wake_held_lease(self) -> None:
        """End this actor's held lease call now (not awaited), so its loop asks again with what
        its engine has free now: the pool cannot see rows run outside it end."""
        if self._holding is not None and self._coordinator_ok and self._coordinator is not None:
            try:
                self._coordinator.wake(self.worker_id)
            except Exception as err:
                logger.warning("could not end a held lease call: %s", err)

    async def _drain_leased_items(self) -> None:
        """Hold the actor's last open call while it runs pool items or the stage still has
        outstanding work (pending, or leased by others and so possibly given back to it at the
        tail); return as soon as the stage's pool is empty (its held lease call returns when it
        empties). A new call arriving keeps the actor alive instead."""
        while self._open_calls == 1 and self._coordinator_ok:
            if self._items_in_flight == 0 and self._pool_outstanding == 0:
                return
            await self._changed.wait()

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._work_loop())

    async def _work_loop(self) -> None:
        last = time.monotonic()
        while self._coordinator_ok:
            now = time.monotonic()
            if self.engine.num_unfinished == 0:
                self.stats.idle_s += now - last
            else:
                self.stats.busy_s += now - last
            last = now
            if not self._open_calls:
                # No call to keep it alive: Ray Data may stop this actor at any moment, so it
                # leases nothing (and holds no lease: nothing to renew) until a call opens.
                await self._changed.wait()
                continue
            progress = self._progress()
            step_s = self._step_s(progress)
            soon, wake_s = slots_freeing_soon(progress.seqs, step_s, self._call_s, _MAX_HOLD_S)
            # One consistent snapshot of the engine (published after its last step) plus the
            # items leased since that it had not accepted yet: counting live counters against
            # an older snapshot would lease twice for slots already refilled. Slots whose
            # sequence ends within the lease round trip count as free: the next item arrives as
            # they free up.
            room = max(0, progress.slots + soon - self._num_taken(len(progress.seqs)))
            # Held until the pool has something for it; with no room, until a slot is about to free.
            wait_s = _MAX_HOLD_S if room else min(_MAX_HOLD_S, wake_s)
            try:
                reply = await self._lease(self._handle(), room, progress, wait_s)
            except Exception as err:
                logger.warning("work pool unavailable (%s); this actor stops pulling work", err)
                self._coordinator_ok = False
                self._notify()
                return
            self._pool_outstanding = reply.num_outstanding
            if reply.items and not self._open_calls:  # its last call closed while the lease was held
                self._release([item.item_id for item in reply.items])
            else:
                self._start(reply.items)
            if reply.give_back:
                started = time.monotonic()
                moved = await self._migrate_out(reply.give_back)  # exactly the planned sequences
                self.stats.num_given_back += moved
                self.stats.migrate_out_s += time.monotonic() - started
                self._event("give_back", time.monotonic() - started, moved)
            self._notify()

    def _start(self, items: list[LeasedItem]) -> None:
        if items and not self.stats.first_items_wall:
            self.stats.first_items_wall = time.time()
        for item in items:
            self._items_in_flight += 1
            self._num_submitted += 1
            max_tokens = int(item.params.get("max_tokens") or SamplingParams.defaults()["max_tokens"])
            self._submitted.append(SeqProgress(item.num_generated, max_tokens, item.num_generated, started=False,
                                               movable=False, running=False))
            task = asyncio.get_running_loop().create_task(self._run_item(item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.stats.num_leased += len(items)

    def _release(self, item_ids: list[str]) -> None:
        try:
            self._handle().release(self.worker_id, item_ids)
        except Exception as err:  # their leases expire back into the pool
            logger.warning("could not release leased items: %s", err)

    def _progress(self) -> WorkerProgress:
        """This actor's load report: its engine's sequences, then the items handed to it that it
        had not accepted by that snapshot (their work is on their way), its step model and what a
        move costs."""
        snapshot = self.probe.snapshot  # one engine step's view, replaced whole (never torn)
        progress = snapshot.progress
        num_incoming = min(len(self._submitted), max(0, self._num_submitted - progress.num_accepted))
        incoming = tuple(islice(reversed(self._submitted), num_incoming))[::-1]
        if self._compute is None:
            self._compute = engine_compute(self.engine.engine.config)
        # Rows it runs outside the pool, as its engine reports them and those the snapshot does not show yet.
        local = [s.num_tokens_left + 1 for s in progress.seqs if not s.in_pool]
        unseen = max(0, self._local_rows - len(local))
        local_tokens = sum(local) + unseen * self._local_output_tokens // max(1, self._local_rows)
        return WorkerProgress(
            slots=self.engine.engine.max_running_seqs, seqs=progress.seqs + incoming, step=snapshot.step,
            move_s_per_token=snapshot.move_s_per_token, kv_s_per_token=self._kv_s_per_token,
            # A give-back and the receiver's lease (two round trips: the receiver's held call
            # returns the item at once), and the step the export waits for.
            move_latency_s=2 * self._call_s + self._step_s_hint, compute=self._compute, local_tokens=local_tokens)

    def _step_s(self, progress: WorkerProgress) -> float:
        model = progress.step.fit()
        running = sum(1 for s in progress.seqs if s.started)
        if model is not None and running:
            self._step_s_hint = model.step_s(running)
        return self._step_s_hint

    async def _lease(self, coordinator: PoolTransport, room: int, progress: WorkerProgress, wait_s: float) -> LeaseReply:
        started = time.monotonic()
        self._holding = room
        try:
            reply = await coordinator.lease(self.worker_id, room, progress, wait_s, self._pool_outstanding)
        finally:
            self._holding = None
        elapsed = time.monotonic() - started
        self._call_s += 0.1 * (max(0.0, elapsed - reply.held_s) - self._call_s)
        self.stats.num_pool_calls += 1
        self.stats.pool_call_s += elapsed
        self.stats.pool_held_s += reply.held_s
        continued = [item.state for item in reply.items if item.state is not None]
        if continued:
            self._event("continue", elapsed, len(continued), sum(len(state) for state in continued))
        return reply

    def _event(self, what: str, seconds: float, count: int, num_bytes: int = 0) -> None:
        self.stats.events.append((time.time(), what, seconds, count, num_bytes))

    async def _migrate_out(self, moves: list[Move]) -> int:
        try:
            return await self.engine.migrate_out(moves)
        except EngineDeadError as err:
            exit_for_restart(err)

    async def _run_item(self, item: LeasedItem) -> None:
        try:
            await self._run_and_complete(item)
        finally:
            self._items_in_flight -= 1
            self._notify()

    async def _run_and_complete(self, item: LeasedItem) -> None:
        item_id = item.item_id
        try:
            state = None if item.state is None else pickle.loads(item.state)
            out = await self.engine.run_one(item.prompt, SamplingParams.from_dict(item.params), state=state,
                                            movable=item.movable)
        except EngineDeadError as err:
            exit_for_restart(err)
        if isinstance(out, MigratedOut):  # taken away at the tail: the pool hands it on
            self.stats.migrated_out_bytes += _kv_bytes(out.state)
            try:
                await self._handle().give_back(self.worker_id, item_id, _pack(out.state),
                                                      len(out.state.output_token_ids), out.state.request_id)
            except Exception as err:  # the lease expires and the item is redone from its start
                logger.warning("could not give a sequence back to the work pool: %s", err)
            return
        if item.state is not None:
            self.stats.num_continued += 1
        if item.owner != self.worker_id:
            self.stats.num_run_for_others += 1
        result = asdict(RowResult.from_output(out))
        try:
            await self._handle().complete(self.worker_id, item_id, result, out.num_generated_tokens)
        except Exception as err:
            logger.warning("could not report a result to the work pool: %s", err)

    def snapshot(self) -> dict:
        """This actor's counters, with the KV tokens its engine recomputed."""
        self.stats.num_recomputed_tokens = self.engine.engine.stats().num_recomputed_tokens
        return asdict(self.stats)

    async def counters(self) -> dict:
        """The stage's pool counters (``Coordinator.counters``); {} if it has no pool."""
        try:
            pool = self._coordinator or find_pool(self.name)
            return {} if pool is None else await pool.counters()
        except Exception:
            return {}
