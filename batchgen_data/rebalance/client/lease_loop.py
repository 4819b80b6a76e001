"""An actor as a worker of its stage's pool (``LeaseLoop``): a background loop that leases items
for the running slots its engine has free or about to free, runs and completes them, sends its
load report with every call, and gives back exactly the sequences a tail plan names (the client's
NOTE, ``client/__init__.py``)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections import deque
from itertools import islice

from batchgen_data.engine.async_engine import MigratedOut
from batchgen_data.engine.migration.costs import MigrationCosts
from batchgen_data.engine.migration.engine_probe import EngineProbe
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.errors import EngineDeadError
from batchgen_data.rebalance.client.membership import engine_compute
from batchgen_data.rebalance.client.state import ClientState, kv_bytes, pack
from batchgen_data.rebalance.coordinator import LeasedItem, LeaseReply
from batchgen_data.rebalance.core.move_rule import Move
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.worker_room import slots_freeing_soon

logger = logging.getLogger(__name__)

# Items handed to the engine and not accepted yet are at most one lease reply's (the engine
# thread takes everything queued before its next step); remembered for the load report.
_MAX_INCOMING = 4096
# The longest a lease call is held open with nothing for this actor (the coordinator caps it at a
# third of the lease timeout): an idle actor makes one call per this long.
MAX_HOLD_S = 5.0


class LeaseLoop:
    """The worker side of one actor's client, over the state it shares with the owner side."""

    def __init__(self, state: ClientState, probe: EngineProbe):
        self.state = state
        self.probe = probe  # its engine's load, published by the engine thread
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._compute = None  # ``engine_compute``, found at the first load report
        self._num_submitted = 0  # items handed to the engine so far (leased and started)
        # The latest of them, as the waiting sequences they are until the engine accepts them
        # (submissions are accepted in order: the last ``submitted - accepted`` are on their way).
        self._submitted: deque[SeqProgress] = deque(maxlen=_MAX_INCOMING)
        self.call_s = 0.005  # lease round trip, moving average (measured, the held time left out)
        self._step_s_hint = 0.05  # the engine's step at its current running set (measured)
        self._kv_s_per_token = MigrationCosts.of_engine(state.engine.engine).transfer_s(1)  # KV shipped per token

    def ensure_running(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        """Stop the loop and the items it runs (tests; an actor's loop ends with its process)."""
        for task in (self._task, *self._tasks):
            if task is not None:
                task.cancel()

    async def drain(self) -> None:
        """Hold the actor's last open call while it runs pool items or the stage still has
        outstanding work (pending, leased by others, or run by others outside the pool: any of it
        may be given to it at the tail); return as soon as the stage's pool is empty (its held lease call returns when it
        empties). A new call arriving keeps the actor alive instead."""
        state = self.state
        while state.open_calls == 1 and state.pool_ok:
            if state.items_in_flight == 0 and state.pool_outstanding == 0:
                return
            await state.changed.wait()

    async def _run(self) -> None:
        state, stats = self.state, self.state.stats
        last = time.monotonic()
        while state.pool_ok:
            now = time.monotonic()
            if state.engine.num_unfinished == 0:
                stats.idle_s += now - last
            else:
                stats.busy_s += now - last
            last = now
            if not state.open_calls:
                # No call to keep it alive: Ray Data may stop this actor at any moment, so it
                # leases nothing (and holds no lease: nothing to renew) until a call opens.
                await state.changed.wait()
                continue
            progress = self.progress()
            step_s = self._step_s(progress)
            soon, wake_s = slots_freeing_soon(progress.seqs, step_s, self.call_s, MAX_HOLD_S)
            # One consistent snapshot of the engine (published after its last step) plus the
            # items leased since that it had not accepted yet: counting live counters against
            # an older snapshot would lease twice for slots already refilled. Slots whose
            # sequence ends within the lease round trip count as free: the next item arrives as
            # they free up.
            room = max(0, progress.slots + soon - state.num_taken(len(progress.seqs)))
            # Held until the pool has something for it; with no room, until a slot is about to free.
            wait_s = MAX_HOLD_S if room else min(MAX_HOLD_S, wake_s)
            try:
                reply = await self._lease(room, progress, wait_s)
            except Exception as err:
                logger.warning("work pool unavailable (%s); this actor stops pulling work", err)
                state.pool_ok = False
                state.notify()
                return
            state.pool_outstanding = reply.num_outstanding
            if reply.items and not state.open_calls:  # its last call closed while the lease was held
                self._release([item.item_id for item in reply.items])
            else:
                self._start(reply.items)
            if reply.give_back:
                started = time.monotonic()
                moved = await self._migrate_out(reply.give_back)  # exactly the planned sequences
                stats.num_given_back += moved
                stats.migrate_out_s += time.monotonic() - started
                self.event("give_back", time.monotonic() - started, moved)
            state.notify()

    def _start(self, items: list[LeasedItem]) -> None:
        stats = self.state.stats
        if items and not stats.first_items_wall:
            stats.first_items_wall = time.time()
        for item in items:
            self.state.items_in_flight += 1
            self._num_submitted += 1
            max_tokens = int(item.params.get("max_tokens") or SamplingParams.defaults()["max_tokens"])
            self._submitted.append(SeqProgress(item.num_generated, max_tokens, item.num_generated, started=False,
                                               movable=False, running=False))
            task = asyncio.get_running_loop().create_task(self._run_item(item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        stats.num_leased += len(items)

    def _release(self, item_ids: list[str]) -> None:
        try:
            self.state.pool.release(self.state.worker_id, item_ids)
        except Exception as err:  # their leases expire back into the pool
            logger.warning("could not release leased items: %s", err)

    def progress(self) -> WorkerProgress:
        """This actor's load report: its engine's sequences, then the items handed to it that it
        had not accepted by that snapshot (their work is on their way), its step model and what a
        move costs."""
        state = self.state
        snapshot = self.probe.snapshot  # one engine step's view, replaced whole (never torn)
        progress = snapshot.progress
        num_incoming = min(len(self._submitted), max(0, self._num_submitted - progress.num_accepted))
        incoming = tuple(islice(reversed(self._submitted), num_incoming))[::-1]
        if self._compute is None:
            self._compute = engine_compute(state.engine.engine.config)
        # Rows it runs outside the pool, as its engine reports them and those the snapshot does not show yet.
        local = [s.num_tokens_left + 1 for s in progress.seqs if not s.in_pool]
        unseen = max(0, state.local_rows - len(local))
        local_tokens = sum(local) + unseen * state.local_output_tokens // max(1, state.local_rows)
        return WorkerProgress(
            slots=state.engine.engine.max_running_seqs, seqs=progress.seqs + incoming, step=snapshot.step,
            move_s_per_token=snapshot.move_s_per_token, kv_s_per_token=self._kv_s_per_token,
            # A give-back and the receiver's lease (two round trips: the receiver's held call
            # returns the item at once), and the step the export waits for.
            move_latency_s=2 * self.call_s + self._step_s_hint, compute=self._compute, local_tokens=local_tokens,
            calls=state.open_calls, max_calls=state.max_calls)

    def _step_s(self, progress: WorkerProgress) -> float:
        model = progress.step.fit()
        running = sum(1 for s in progress.seqs if s.started)
        if model is not None and running:
            self._step_s_hint = model.step_s(running)
        return self._step_s_hint

    async def _lease(self, room: int, progress: WorkerProgress, wait_s: float) -> LeaseReply:
        state, stats = self.state, self.state.stats
        started = time.monotonic()
        state.holding = room
        try:
            reply = await state.pool.lease(state.worker_id, room, progress, wait_s, state.pool_outstanding)
        finally:
            state.holding = None
        elapsed = time.monotonic() - started
        self.call_s += 0.1 * (max(0.0, elapsed - reply.held_s) - self.call_s)
        stats.num_pool_calls += 1
        stats.pool_call_s += elapsed
        stats.pool_held_s += reply.held_s
        continued = [item.state for item in reply.items if item.state is not None]
        if continued:
            self.event("continue", elapsed, len(continued), sum(len(s) for s in continued))
        return reply

    def event(self, what: str, seconds: float, count: int, num_bytes: int = 0) -> None:
        self.state.stats.events.append((time.time(), what, seconds, count, num_bytes))

    async def _migrate_out(self, moves: list[Move]) -> int:
        try:
            return await self.state.engine.migrate_out(moves)
        except EngineDeadError as err:
            self.state.on_engine_dead(err)

    async def _run_item(self, item: LeasedItem) -> None:
        try:
            await self._run_and_complete(item)
        finally:
            self.state.items_in_flight -= 1
            self.state.notify()

    async def _run_and_complete(self, item: LeasedItem) -> None:
        state, stats = self.state, self.state.stats
        try:
            moved = None if item.state is None else pickle.loads(item.state)
            out = await state.engine.run_one(item.prompt, SamplingParams.from_dict(item.params), state=moved,
                                             movable=item.movable)
        except EngineDeadError as err:
            state.on_engine_dead(err)
        if isinstance(out, MigratedOut):  # taken away at the tail: the pool hands it on
            stats.migrated_out_bytes += kv_bytes(out.state)
            try:
                await state.pool.give_back(state.worker_id, item.item_id, pack(out.state),
                                           len(out.state.output_token_ids), out.state.request_id)
            except Exception as err:  # the lease expires and the item is redone from its start
                logger.warning("could not give a sequence back to the work pool: %s", err)
            return
        if item.state is not None:
            stats.num_continued += 1
        if item.owner != state.worker_id:
            stats.num_run_for_others += 1
        result = state.codec.to_wire(state.codec.from_output(out))
        try:
            await state.pool.complete(state.worker_id, item.item_id, result, out.num_generated_tokens)
        except Exception as err:
            logger.warning("could not report a result to the work pool: %s", err)
