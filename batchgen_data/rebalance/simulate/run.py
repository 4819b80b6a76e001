"""The event loop: one stage of ``actors`` modelled engines over a scenario's rows, with or
without the work pool (``simulate``).

NOTE: what is modelled, and how.
  * Blocks of ``block_rows`` rows in input order reach the actors as Ray Data's actor pool hands
    them out: once every actor has started, each block goes to the actor with the fewest tasks
    in flight (the first such), while one holds fewer than ``tasks_in_flight``. An actor runs
    at most ``concurrent_calls`` of them as calls; the others wait at the actor, in order, unseen
    by the stage, until a call ends. A call ends when all its rows have results, wherever they
    ran, and frees its slot.
  * Without rebalancing, a call's rows queue on its own actor's engine.
  * With it, the stage's client rules: while the stage has no pool, a block whose rows fit the
    engine's free slots and KV runs there (``core/local_first``); the first that does not starts
    the pool (its rows that fit start here, the rest go to the pool), and from then on every
    block is submitted to it. Rows started outside the pool are movable once it exists: a tail
    plan that names one adopts it into the pool (``WorkPool.adopt``). An actor calls as it joins
    (its first load report), then at a step boundary where it has room (free slots, and slots
    about to free: ``core/worker_room``) and the pool changed since its last call, or its held
    call's wait bound passed; an idle actor waits for a change (a round trip later) or for its
    bound. Each call carries the actor's load report, and the pool's tail plan
    (``WorkPool.plan_give_back``) names the sequences it gives back; between calls its held call
    is planned again whenever the stage's load reports changed (as the coordinator does), the
    moves taken at its next step boundary. The receiver pays the move (KV shipped, or its tokens
    recomputed, whichever the model says is cheaper) in the step that admits it.
  * Steps take ``ActorModel`` time: the step model at the running-set size, plus the prefill of
    the sequences admitted in that step; every running sequence gains a token per step.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from batchgen_data.rebalance.core.local_first import EngineRoom, rows_here
from batchgen_data.rebalance.core.pool import WorkPool
from batchgen_data.rebalance.core.step_model import StepSums
from batchgen_data.rebalance.core.worker_room import slots_freeing_soon
from batchgen_data.rebalance.simulate.actor import SimEngine, SimSeq
from batchgen_data.rebalance.simulate.config import SimConfig, SimResult
from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.scenario import Row

# The longest a lease call is held with nothing for the actor (the stage client's bound).
MAX_HOLD_S = 5.0


@dataclass(slots=True)
class _Call:
    owner: int
    left: int  # rows without a result yet
    batch_key: str | None = None  # its pool batch, if any of its rows went there


class Simulation:
    def __init__(self, rows: Sequence[Row], config: SimConfig, model: ActorModel):
        if min(config.actors, config.max_num_seqs, config.block_rows, config.tasks_in_flight,
               config.concurrent_calls or 1) < 1:
            raise ValueError(f"actors, max_num_seqs, block_rows, tasks_in_flight and concurrent_calls must be "
                             f">= 1: {config}")
        self.rows, self.config, self.model = rows, config, model
        self.engines = [SimEngine(f"actor-{i}", model, config.max_num_seqs) for i in range(config.actors)]
        self.pool = WorkPool(lease_timeout_s=1e12) if config.rebalance else None
        self.pool_started = False
        self.step_sums = StepSums()
        self.step_sums.calibrate(model.step_model)  # every actor's report: its engine's calibrated line
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self.events: list[tuple[float, int, str, int]] = []
        self.num_events = 0
        self.blocks = deque(range(0, len(rows), config.block_rows))
        self.calls: dict[int, _Call] = {}
        self.open_calls = [0] * config.actors  # tasks in flight: calls running and blocks waiting at the actor
        self.queued: list[deque[int]] = [deque() for _ in range(config.actors)]  # blocks waiting at the actor
        self.concurrent_calls = config.concurrent_calls or config.tasks_in_flight
        self.ready = [False] * config.actors
        self.stepping = [False] * config.actors
        self.wake_at = [None] * config.actors  # an idle actor's pending wake-up
        self.version = 0  # bumped at every pool change an idle or waiting actor may act on
        self.seen_version = [-1] * config.actors
        self.call_room = [0] * config.actors  # the room its last call had (none: held until a slot frees)
        self.last_call = [-float("inf")] * config.actors  # its first call comes as it joins, room or not
        self.planned_at = [-1] * config.actors  # the pool's load reports its held call's last plan saw
        self.items: dict[str, tuple[int, int]] = {}  # pool item -> (row, call)
        self.adopted: set[str] = set()  # items of rows run outside the pool, adopted as they moved
        self.last_end = 0.0
        self.rows_left = len(rows)
        self.moves = self.moved_tokens = self.lease_calls = self.steps = self.rows_in_pool = 0

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for i in range(self.config.actors):
            self._push(self.model.startup_s, "ready", i)
        while self.events and self.rows_left:
            self.now, _, kind, i = heapq.heappop(self.events)
            if kind == "ready":
                self.ready[i] = True
                if self.pool is not None and self.pool_started:
                    self.pool.register(self.engines[i].name, self.now, ready=True, load_s=self.model.startup_s)
                self._dispatch()  # the blocks' receivers first: an idle actor's first call comes after
                self._wake(i, self.now)
            elif kind == "step":
                self._end_step(i)
            elif kind == "wake" and self.wake_at[i] == self.now:
                self.wake_at[i] = None
                self._begin_step(i)
        if self.rows_left or (self.pool is not None and (self.pool.pending or self.pool.leases)):
            raise RuntimeError(f"the simulation stopped with {self.rows_left} rows not done and "
                               f"{len(self.pool.pending) + len(self.pool.leases) if self.pool else 0} pool items "
                               "outstanding (a bug in the model or the policy)")
        span = max(1e-12, self.last_end - self.model.startup_s)
        busy = sum(e.busy_s for e in self.engines)
        return SimResult(self.last_end, self.moves, self.moved_tokens,
                         max(0.0, 1.0 - busy / (span * self.config.actors)), self.rows_in_pool,
                         self.lease_calls, self.steps)

    def _push(self, at: float, kind: str, actor: int) -> None:
        self.num_events += 1
        heapq.heappush(self.events, (at, self.num_events, kind, actor))

    def _wake(self, i: int, at: float) -> None:
        if not self.stepping[i] and (self.wake_at[i] is None or at < self.wake_at[i]):
            self.wake_at[i] = at
            self._push(at, "wake", i)

    def _changed(self) -> None:
        """The pool changed: idle actors ask again a round trip later."""
        self.version += 1
        for i in range(self.config.actors):
            if self.ready[i] and not self.stepping[i]:
                self._wake(i, self.now + self.model.call_s)

    # -- Ray Data's side: blocks to calls ------------------------------------------------------

    def _dispatch(self) -> None:
        """Ray Data's actor pool (``_ActorPool.pick_actor``): after waiting for its actors to
        start, each block to the least busy actor with a free slot; idle receivers wake."""
        if not all(self.ready):
            return
        while self.blocks:
            i = min(range(self.config.actors), key=self.open_calls.__getitem__)
            if self.open_calls[i] >= self.config.tasks_in_flight:
                return
            self.open_calls[i] += 1
            if self.open_calls[i] - len(self.queued[i]) > self.concurrent_calls:
                self.queued[i].append(self.blocks.popleft())  # the actor's calls are all busy
                continue
            self._start_call(i, self.blocks.popleft())
            self._wake(i, self.now)

    def _start_call(self, i: int, start: int) -> None:
        """A block reaches actor ``i``: its rows start there, or go to the pool (module NOTE)."""
        engine, rows = self.engines[i], list(range(start, min(len(self.rows), start + self.config.block_rows)))
        call = self.calls[start] = _Call(i, len(rows))
        if self.pool is None:
            local, pooled = rows, []
        elif self.pool_started:
            local, pooled = [], rows
        else:
            claimed = sum(s.full_length for s in (*engine.running, *engine.waiting))
            room = EngineRoom(max(0, engine.max_num_seqs - engine.num_seqs), max(0, self.model.kv_capacity_tokens - claimed))
            local = [rows[k] for k in rows_here([self.rows[r].prompt_tokens + self.rows[r].max_tokens for r in rows], room)]
            pooled = sorted(set(rows) - set(local))
            if pooled:
                self._start_pool()
        for r in local:  # movable once the stage has a pool: adopted into it as they move
            row = self.rows[r]
            engine.add(SimSeq(r, start, row.prompt_tokens, row.output_tokens, row.max_tokens,
                              movable=self.pool is not None))
        if pooled:
            call.batch_key = f"c{start}"
            self.pool.submit(call.batch_key, engine.name,
                             [(self.rows[r].prompt, {"max_tokens": self.rows[r].max_tokens}) for r in pooled], self.now)
            for k, r in enumerate(pooled):
                self.items[f"{call.batch_key}/{k}"] = (r, start)
            self.rows_in_pool += len(pooled)
            self._changed()

    def _start_pool(self) -> None:
        """The first block whose rows would queue starts the stage's pool; every ready actor joins."""
        self.pool_started = True
        for i, engine in enumerate(self.engines):
            if self.ready[i]:
                self.pool.register(engine.name, self.now, ready=True, load_s=self.model.startup_s)

    def _finish(self, i: int, seq: SimSeq) -> None:
        """A row has its result: its call may end, and the owner then takes the next block."""
        self.last_end = max(self.last_end, self.now)
        self.rows_left -= 1
        call = self.calls[seq.call]
        if seq.item_id is not None:
            self.pool.complete(self.engines[i].name, seq.item_id, None, seq.num_generated)
            if seq.item_id in self.adopted:  # its owner takes its result as it comes
                self.adopted.discard(seq.item_id)
                self.pool.take_batch(self.pool.items[seq.item_id].batch_key)
            self._changed()
        call.left -= 1
        if call.left == 0:
            self.open_calls[call.owner] -= 1
            if call.batch_key is not None:
                self.pool.take_batch(call.batch_key)
            if self.queued[call.owner]:  # the next block waiting at the actor becomes a call
                self._start_call(call.owner, self.queued[call.owner].popleft())
                self._wake(call.owner, self.now)
            self._dispatch()
            if call.owner != i:
                self._wake(call.owner, self.now)

    # -- an actor ------------------------------------------------------------------------------

    def _begin_step(self, i: int) -> None:
        """At a step boundary: lease (and give back what the pool names), admit, step; or wait."""
        if self.stepping[i] or not self.ready[i]:
            return
        engine = self.engines[i]
        if self.pool_started:
            self._lease(i)
        extra = engine.admit()
        if not engine.running:
            if self.pool_started:  # a held call: back at a change, at its bound, or a timed change
                next_change = self.pool.next_change_s(engine.name, self.now)
                self._wake(i, min(self.now + MAX_HOLD_S, next_change if next_change is not None else float("inf")))
            return
        step_s = self.model.step_model.step_s(len(engine.running)) + extra
        if self.config.jitter:
            step_s *= max(0.1, 1.0 + self.config.jitter * self.rng.gauss(0.0, 1.0))
        engine.busy_s += step_s
        self.stepping[i] = True
        self.wake_at[i] = None
        self._push(self.now + step_s, "step", i)

    def _end_step(self, i: int) -> None:
        self.stepping[i] = False
        self.steps += 1
        for seq in self.engines[i].step():
            self._finish(i, seq)
        self._begin_step(i)

    def _lease(self, i: int) -> None:
        """A lease call where it has room and the pool changed since its last, or its last had no
        room (held until a slot frees), or its held call's bound passed: its load report in, items
        and planned give-backs out."""
        engine, pool, model = self.engines[i], self.pool, self.model
        step_s = model.step_model.step_s(max(1, len(engine.running)))
        report = engine.report(self.step_sums, move_latency_s=2 * model.call_s + step_s,
                               calls=self.open_calls[i] - len(self.queued[i]), max_calls=self.concurrent_calls)
        soon, _ = slots_freeing_soon(report.seqs, step_s, model.call_s, MAX_HOLD_S)
        room = max(0, engine.max_num_seqs + soon - engine.num_seqs)
        changed = self.seen_version[i] != self.version or not self.call_room[i]
        if not (room and changed) and self.now - self.last_call[i] < MAX_HOLD_S:
            # Its call is held: the coordinator plans it again whenever the load reports change.
            if self.planned_at[i] != pool.num_reports:
                self.planned_at[i] = pool.num_reports
                self._give_back(i, pool.plan_give_back(engine.name, self.now))
            return
        self.seen_version[i], self.last_call[i], self.call_room[i] = self.version, self.now, room
        self.lease_calls += 1
        items = pool.lease(engine.name, room, self.now, report)
        for item in items:
            r, call = self.items[item.item_id]
            row = self.rows[r]
            seq = SimSeq(r, call, row.prompt_tokens, row.output_tokens, row.max_tokens, item_id=item.item_id,
                         num_generated=item.num_generated, movable=item.movable)
            if item.state is not None:  # moved mid-generation: its KV arrives, or is recomputed
                seq.arrive_s = item.state * model.move_s_per_token
            engine.add(seq)
        pool.hold(engine.name, max(0, room - len(items)), self.now)
        self.planned_at[i] = pool.num_reports
        self._give_back(i, pool.plan_give_back(engine.name, self.now))

    def _give_back(self, i: int, moves) -> None:
        """Export the sequences a tail plan names: into the pool for their receivers."""
        engine, pool = self.engines[i], self.pool
        if moves and not (self.config.moves_after_input and self.blocks):
            for seq in engine.take({m.request_id for m in moves}):
                state = seq.num_tokens if seq.started else None
                if seq.item_id is None:  # a row run outside the pool: adopted as it moves
                    key = f"adopted-{seq.row}"
                    row = self.rows[seq.row]
                    pool.adopt(engine.name, key, row.prompt, {"max_tokens": row.max_tokens}, state,
                               seq.num_generated, self.now, seq.request_id)
                    seq.item_id = f"{key}/0"
                    self.items[seq.item_id] = (seq.row, seq.call)
                    self.adopted.add(seq.item_id)
                elif not pool.give_back(engine.name, seq.item_id, state, seq.num_generated, self.now, seq.request_id):
                    raise RuntimeError(f"the pool refused a planned give-back of {seq.item_id}")
                self.moves += 1
                self.moved_tokens += seq.num_tokens if seq.started else 0
            self._changed()


def simulate(rows: Sequence[Row], config: SimConfig, model: ActorModel) -> SimResult:
    """One run of the stage (module NOTE)."""
    return Simulation(rows, config, model).run()
