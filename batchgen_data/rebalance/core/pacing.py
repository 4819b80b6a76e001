"""PACING: how many sequences a worker runs while it holds a row long for the job (``Pace``).
Pure Python, over the ``WorkPool``'s state (``pool.py``).

A sequence gains one token a step, and a step costs more the more sequences run beside it
(``StepModel``). A long row in a full running set therefore ends far later than the rest of the
job: on the demo model a 3,000-token row takes 160 s among 64 sequences and 25 s alone. Moving
work off its worker once the stage has nothing pending (``tail.py``) comes too late for it.

NOTE: the rule.
  * Only once the stage's input is all in (``input_complete``): before, the work ahead is not
    known, and a projected end would come too soon.
  * The pool projects when the stage can end (``stage_end_s``): the earliest time by which the
    workers, each running at most the sequences that let its longest one end by then
    (``running_cap``), get through the outstanding work at the stage's step model. The longest
    pending items count as one more long row each on the workers holding the shortest. At most
    one worker in ``_PACED_SHARE`` is paced; the others run full sets. Where that projection is
    not clearly sooner than full sets everywhere (``_MIN_GAIN``), nothing is paced: the usual
    case, where the work per worker dwarfs any one row.
  * A paced worker leases an item only while its running set stays within the cap of the
    longest sequence it would then hold. A worker not yet paced may take one long item while
    fewer than the most workers are paced (its short rows drain, and it refills no further than
    the cap); a worker that may not be paced takes a long item only where no paced worker has a
    home for it (room now, or once its short rows end soon: ``Home``).
  * Long rows thus start early (the lease is longest-first) and gather on a few workers running
    small sets, while the others run full sets of the short rows. A sequence given back at the
    tail goes where the move rule placed it, whatever the pace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchgen_data.rebalance.core.pool_state import leased_since, pooled_step_model
from batchgen_data.rebalance.core.projection import running_cap, stage_end_s
from batchgen_data.rebalance.core.step_model import StepModel

if TYPE_CHECKING:
    from batchgen_data.rebalance.core.pool import WorkPool

# The projected end is recomputed at most this often (seconds of the pool's clock): it moves
# slowly, and every lease call would otherwise walk every worker's sequences.
_REFRESH_S = 0.25
# At most one worker in this many runs a paced set: the others keep full sets for the rest.
_PACED_SHARE = 2
# Pacing starts only where it projects the stage to end within this share of the time full sets
# everywhere would take.
_MIN_GAIN = 0.9
# A long item waits for a paced worker's room only where its short rows end within this share of
# the time left; else a worker that is not paced takes it.
_DRAIN_SHARE = 0.1
_MIN_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class Home:
    """A paced worker as its last lease left it: whether a long item would fit its pace."""

    longest: float
    held: int
    short: tuple  # tokens left of its rows that are not long, shortest first
    slots: int

    def takes(self, tokens_left: float, time_left_s: float, model: StepModel) -> bool:
        """It has room for the item within the cap the item would set, now or once enough of its
        short rows end, within ``_DRAIN_SHARE`` of the time left."""
        cap = running_cap(max(self.longest, tokens_left), time_left_s, model, self.slots)
        need = self.held - cap + 1  # rows that must end first
        if need <= 0:
            return True
        return need <= len(self.short) and self.short[need - 1] * model.step_s(self.held) <= _DRAIN_SHARE * time_left_s


@dataclass(slots=True)
class PaceState:
    """The pool's pacing records."""

    computed_at: float = -math.inf
    model: StepModel | None = None  # None: nothing is paced now
    end: float = 0.0  # the projected end, on the pool's clock
    paced: set = field(default_factory=set)  # the workers paced
    max_paced: int = 0
    homes: dict = field(default_factory=dict)  # paced worker -> its ``Home``
    caps: dict = field(default_factory=dict)  # paced worker -> (its cap, when its lease set it)
    room: dict = field(default_factory=dict)  # paced worker -> items its cap lets it take now
    homed: dict = field(default_factory=dict)  # item -> when a worker first left it for a paced one's room

    def stop(self) -> None:
        """Nothing is paced now."""
        self.model = None
        self.paced, self.homes, self.caps, self.room, self.homed = set(), {}, {}, {}, {}

    def forget(self, worker: str) -> None:
        for table in (self.homes, self.caps, self.room):
            table.pop(worker, None)
        self.paced.discard(worker)


@dataclass(slots=True)
class Pace:
    """One lease call's pacing for a worker: what it holds, and the stage's projected end."""

    model: StepModel
    slots: int
    time_left_s: float  # until the projected end
    lefts: list  # tokens left of what it holds (in its engine, leased to it since its report)
    may_pace: bool  # False: enough others are paced; it runs full sets
    others: list  # the other paced workers' ``Home``
    longest: float = 0.0
    took_long: bool = False  # this call gave it the one long item an unpaced worker may take
    left_for_home: bool = False  # its last refusal left the item for another's home

    def __post_init__(self):
        self.longest = max(self.lefts, default=0.0)

    def is_long(self, tokens_left: float) -> bool:
        return running_cap(tokens_left, self.time_left_s, self.model, self.slots) < self.slots

    @property
    def cap(self) -> int:
        """The most sequences it may run, for the longest it holds."""
        if not self.may_pace:
            return self.slots
        return running_cap(self.longest, self.time_left_s, self.model, self.slots)

    @property
    def paced(self) -> bool:
        return self.cap < self.slots

    def admits(self, tokens_left: float, waited_s: float = 0.0) -> bool:
        """Whether the worker may take an item with ``tokens_left``, besides what it holds and
        has taken in this call (module NOTE). ``waited_s``: how long the item has waited for a home; past
        ``_DRAIN_SHARE`` of the time left (at least ``_MIN_WAIT_S``) it goes where it can start."""
        cap = running_cap(max(self.longest, tokens_left), self.time_left_s, self.model, self.slots)
        if cap >= self.slots:
            return True  # not paced by it (the room asked for is the caller's own)
        homed = (waited_s <= max(_MIN_WAIT_S, _DRAIN_SHARE * self.time_left_s)
                 and any(home.takes(tokens_left, self.time_left_s, self.model) for home in self.others))
        self.left_for_home = homed
        if not self.may_pace:
            return not homed
        if len(self.lefts) + 1 <= cap:
            return True
        if not self.paced and not self.took_long and not homed:
            self.took_long = True
            return True
        return False

    def at_cap(self, tokens_left: float) -> bool:
        """Refused an item no longer than what it holds: it runs as many as its cap allows, and
        no shorter item fits either."""
        return self.may_pace and tokens_left <= self.longest and len(self.lefts) + 1 > self.cap

    def taken(self, tokens_left: float) -> None:
        self.lefts.append(tokens_left)
        self.longest = max(self.longest, tokens_left)

    def home(self) -> Home:
        """This worker as a home for long items, after this call."""
        short = tuple(sorted(left for left in self.lefts if not self.is_long(left)))
        return Home(self.longest, len(self.lefts), short, self.slots)


def input_complete(pool: WorkPool, now: float) -> bool:
    """Whether the stage's input is all in: some alive actor that has had a block runs fewer
    batch calls than it may (Ray Data hands each block to the least busy actor, so a free call
    slot means no block is waiting)."""
    return any(load.progress.max_calls is not None and load.progress.calls < load.progress.max_calls
               and (load.progress.calls > 0 or w in pool.owners)
               for w, load in pool.loads.items() if pool.is_alive(w, now))


def at_pace(pool: WorkPool, worker: str, now: float) -> bool:
    """A paced worker already runs as many as its last lease's cap allows (that cap still fresh):
    it takes nothing now, and the lease need not weigh every item to say so."""
    note, load = pool.pacing.caps.get(worker), pool.loads.get(worker)
    if note is None or load is None or now - note[1] >= _REFRESH_S:
        return False
    if any(worker in plan.values() for plan in pool.planned_moves.values()):
        return False  # a tail plan sends it sequences: those it takes whatever its pace
    return len(load.progress.seqs) + len(leased_since(load, pool.leases, worker)) >= note[0]


def pace_for(pool: WorkPool, worker: str, now: float, cost: dict[str, float], num_members: int) -> Pace | None:
    """``worker``'s pacing for this lease call, or None (nothing is paced now)."""
    load = pool.loads.get(worker)
    state = pool.pacing
    if load is None or not input_complete(pool, now):
        return None
    _project(pool, now, cost, num_members)
    if state.model is None:
        return None
    return Pace(state.model, load.progress.slots, max(0.0, state.end - now),
                _held_lefts(pool, worker, load, cost),
                worker in state.paced or len(state.paced) < state.max_paced,
                [home for w, home in state.homes.items() if w != worker])


def record(pool: WorkPool, worker: str, pace: Pace | None, now: float) -> None:
    """After a lease: the worker's cap, room and home, if it is paced; else none."""
    state = pool.pacing
    if pace is None or not pace.paced:
        state.forget(worker)
        return
    state.paced.add(worker)
    state.caps[worker] = (pace.cap, now)
    state.room[worker] = max(0, pace.cap - len(pace.lefts))
    state.homes[worker] = pace.home()


def _held_lefts(pool: WorkPool, worker: str, load, cost: dict[str, float]) -> list[float]:
    """Tokens left of what ``worker`` holds: its engine's sequences by its last report, and the
    items leased to it since (a leased item's own record keeps its length at lease time)."""
    tokens_left = pool.lengths.tokens_left
    return ([tokens_left(s.num_generated, s.max_tokens) for s in load.progress.seqs]
            + [cost[item.item_id] for item in leased_since(load, pool.leases, worker) if item.item_id in cost])


def _project(pool: WorkPool, now: float, cost: dict[str, float], num_members: int) -> None:
    """The stage's projected end and the workers paced, recomputed at most every ``_REFRESH_S``
    (module NOTE)."""
    state = pool.pacing
    if now - state.computed_at < _REFRESH_S:
        return
    state.computed_at, state.model = now, None
    alive = {w: load for w, load in pool.loads.items() if pool.is_alive(w, now)}
    model = pooled_step_model(pool.step_total, pool.loads, alive)
    if model is None or not alive:
        state.stop()
        return
    # The work left: pending items, and what each worker holds by its report (a leased item's own
    # record keeps its length at lease time), with the items leased to it since.
    by_worker: dict[str, float] = {}
    work = sum(cost[i] for i in pool.pending if i in cost)
    for w, load in alive.items():
        lefts = _held_lefts(pool, w, load, cost)
        by_worker[w] = max(lefts, default=0.0)
        work += sum(lefts)
    slots = max(load.progress.slots for load in alive.values())
    workers = [(by_worker[w], alive[w].progress.slots) for w in alive]
    workers += [(0.0, slots)] * max(0, num_members - len(workers))  # members that have not reported yet
    max_paced = max(1, len(workers) // _PACED_SHARE)
    # The longest pending items will each pace a worker too: as if the longest went to the
    # worker holding the shortest, the next to the next, one each.
    pending = sorted((cost[i] for i in pool.pending if i in cost), reverse=True)[:len(workers)]
    workers.sort()
    for k, left in enumerate(pending):
        workers[k] = (max(workers[k][0], left), workers[k][1])
    paced_s = stage_end_s(workers, work, model, max_paced=max_paced)
    full_s = max(work / sum(n / model.step_s(n) for _, n in workers),
                 max(left * model.step_s(n) for left, n in workers))
    if paced_s > _MIN_GAIN * full_s:
        state.stop()
        return
    state.model, state.end, state.max_paced = model, now + paced_s, max_paced
    time_left = paced_s
    ranked = sorted(((left, w) for w, left in by_worker.items()
                     if running_cap(left, time_left, model, alive[w].progress.slots) < alive[w].progress.slots),
                    reverse=True)
    state.paced = {w for _, w in ranked[:max_paced]}
    for worker in set(state.homes) - state.paced:
        state.forget(worker)
