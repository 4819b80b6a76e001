"""Who shares a stage's work (``Members``) and how the longest items are spread while some of them
have not leased yet (``Spread``). Pure Python; ``work_pool.WorkPool`` holds one ``Members``.

The fair share of the outstanding work is taken over the stage's members, not over whoever
happened to ask first: at job start the first actor to lease was the only one that had asked,
and took every long row (issue #33: all eight in 4 runs of 5; split 5/3, the job was 1.23x
faster). Members are the workers taking part now (a lease call of theirs held open by the
coordinator, or a call just made: an actor with a call of its own always is, and one without
cannot lease) and those that registered when their actor started, before it loaded its model,
and have not leased yet, for as long as they may still come.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

# A worker that asked for work this recently takes part (a member, and a receiver at the tail)
# even while no lease call of its is held (it is between two calls).
ACTIVE_WINDOW_S = 1.0
# A member whose actor is ready (its engine built) but that has not leased within this long is not
# waited for: Ray Data hands a ready actor its first batch within ~50 ms when it has one for it
# (measured on the demo model's stage), and an actor without a call of its own cannot lease.
_FIRST_CALL_GRACE_S = 0.5
# A member still loading its model is waited for until its start plus the slowest load time of
# the members ready so far, this much longer: actors loading at once on shared cores take
# different times (3.4 s and 4.1 s for two demo-model actors on 2 cores). Waiting longer costs the
# members that lease meanwhile (their share of the long rows starts that much later) where the
# late one never comes (Ray Data gave it no batch); splitting eight long rows of the demo model
# gains 1.5-2.5 s.
_LOAD_TIME_SLACK = 0.25


@dataclass(slots=True)
class _Member:
    registered: float  # when its actor started (before loading its model)
    ready: float | None = None  # when its engine was built (None: still loading)
    load_s: float | None = None  # how long its actor took from its start to ready, as it measured
    first_lease_seen: float | None = None  # the first lease call of any worker since it registered


class Members:
    """The stage's workers as the pool shares work over them: registrations, lease calls (held
    ones included), and who is waited for."""

    def __init__(self, lease_timeout_s: float):
        self.lease_timeout_s = lease_timeout_s
        self.registered: dict[str, _Member] = {}  # the stage's actors, from their start
        self.last_seen: dict[str, float] = {}  # worker -> its last lease call
        self.holding: dict[str, int] = {}  # worker -> max_items of its lease call held open now

    def register(self, worker: str, now: float, ready: bool = False, load_s: float | None = None) -> None:
        member = self.registered.setdefault(worker, _Member(now))
        if ready and member.ready is None:
            member.ready, member.load_s = now, load_s

    def saw_lease(self, worker: str, now: float) -> None:
        self.last_seen[worker] = now
        for member in self.registered.values():
            if member.first_lease_seen is None:
                member.first_lease_seen = now

    def current(self, now: float) -> set[str]:
        """The members now: those taking part (``takes_part``) and the registered ones that have
        not leased yet while they may still come (``_waited_until``)."""
        members = set(self.holding)
        members.update(w for w, seen in self.last_seen.items() if now - seen <= ACTIVE_WINDOW_S)
        members.update(w for w, member in self.registered.items()
                       if w not in self.last_seen and now <= self._waited_until(member))
        return members

    def takes_work(self, worker: str, now: float) -> bool:
        """It would lease an item now: a held call of its asks for some, or it just called."""
        return self.holding.get(worker, 0) > 0 or now - self.last_seen.get(worker, -math.inf) <= ACTIVE_WINDOW_S

    def num_turns(self, worker: str, members: set[str]) -> int:
        """``worker`` and the members yet to take their first turn (``Spread``)."""
        return 1 + sum(1 for w in members if w != worker and w not in self.last_seen)

    def waited_until_times(self) -> list[float]:
        """When each registered member not leased yet stops being waited for."""
        return [self._waited_until(m) for w, m in self.registered.items() if w not in self.last_seen]

    def _waited_until(self, member: _Member) -> float:
        """Until when a registered member that has not leased yet is waited for: once ready,
        ``_FIRST_CALL_GRACE_S``; while its actor loads its model, until it should be ready too
        (its start plus the longest load time the ready members measured, same model and
        config, with ``_LOAD_TIME_SLACK``) and that grace; with no load time known, a lease
        timeout after the first lease the pool saw since it registered."""
        if member.ready is not None:
            return member.ready + _FIRST_CALL_GRACE_S
        load_times = [m.load_s for m in self.registered.values() if m.load_s is not None]
        if load_times:
            return member.registered + (1 + _LOAD_TIME_SLACK) * max(load_times) + _FIRST_CALL_GRACE_S
        if member.first_lease_seen is None:
            return math.inf  # nobody leases yet: the stage is starting
        return member.first_lease_seen + self.lease_timeout_s

    def forget(self, worker: str) -> None:
        for table in (self.registered, self.last_seen, self.holding):
            table.pop(worker, None)


@dataclass(frozen=True, slots=True)
class Spread:
    """Admission while some member has not leased yet: the longest items go round-robin. For
    every length, a worker holds at most its turn's share of the items at least that long that
    others do not hold yet: ``ceil(n / num_turns)``, where ``num_turns`` counts the members yet
    to take their first turn, this worker included (so the first of two actors takes every
    other long row, the second the rest, and of four long rows over three actors, two, one and
    one).

    Example:
        >>> spread = Spread(costs=[8, 8, 256, 256], others=[], mine=[], num_turns=2)
        >>> spread.allows(256, num_chosen=0), spread.allows(256, num_chosen=1), spread.allows(8, num_chosen=1)
        (True, False, True)
    """

    costs: list  # every outstanding item's cost, ascending
    others: list  # costs of the items other workers hold, ascending
    mine: list  # costs of the items this worker holds, ascending
    num_turns: int

    def allows(self, cost: float, num_chosen: int) -> bool:
        """Whether one more item of ``cost`` fits, ``num_chosen`` (all at least as long) chosen."""
        at_least = len(self.costs) - bisect_left(self.costs, cost)
        others = len(self.others) - bisect_left(self.others, cost)
        mine = len(self.mine) - bisect_left(self.mine, cost) + num_chosen
        return mine + 1 <= math.ceil((at_least - others) / self.num_turns)
