"""A sequence leaving its worker at the tail, into the pool for the receiver its move was planned
for: a leased item given back (``give_back``), or a row its owner ran outside the pool, adopted as
it moves (``adopt``). Pure Python, over the ``WorkPool``'s state (``pool.py``).

A row an actor started on its own engine before the stage had a pool is movable like any pooled
sequence once the pool exists: the pool sees it only in its worker's load report until a tail
plan names it, and then it enters the pool as a batch of its own (one item, pending, holding the
exported state), which its owner awaits as it awaits a pooled batch. Without that, the rows that
started a job (where clustered and descending inputs put their long ones) are pinned to the
actors that got them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen_data.rebalance.core.work_item import WorkItem

if TYPE_CHECKING:
    from batchgen_data.rebalance.core.pool import WorkPool

# How long a given-back sequence is kept from the worker that gave it back.
GIVEN_BACK_RESERVE_S = 1.0


def give_back(pool: WorkPool, worker: str, item_id: str, state: Any, num_generated: int, now: float,
              request_id: int | None = None) -> bool:
    """End a lease with the sequence's exported state (``WorkPool.give_back``); False (state
    dropped) if the lease is no longer this worker's."""
    lease = pool.leases.get(item_id)
    if lease is None or lease.worker != worker or item_id in pool.results:
        return False
    del pool.leases[item_id]
    _to_receiver(pool, worker, pool.items[item_id], state, num_generated, now, request_id)
    return True


def adopt(pool: WorkPool, worker: str, batch_key: str, prompt: Any, params: dict, state: Any,
          num_generated: int, now: float, request_id: int | None = None) -> bool:
    """A row ``worker`` ran outside the pool, exported by a planned move: it becomes the one item
    of batch ``batch_key``, owned by ``worker`` (which awaits it as a pooled batch), pending for
    the planned receiver. False if that batch exists already (a repeated call adds nothing)."""
    if batch_key in pool.batches:
        return False
    pool.submit(batch_key, worker, [(prompt, params)], now)
    pool.pending.pop()  # submitted last in the queue: it goes to the front, for its receiver
    pool.counters.num_adopted += 1
    _to_receiver(pool, worker, pool.items[pool.batches[batch_key].item_ids[0]], state, num_generated, now, request_id)
    return True


def _to_receiver(pool: WorkPool, worker: str, item: WorkItem, state: Any, num_generated: int, now: float,
                 request_id: int | None) -> None:
    """The item pending again at the front, with its state, kept from ``worker`` for a while and
    for the receiver its giver's last plan chose (by the giver engine's ``request_id``)."""
    item.state, item.num_generated = state, num_generated
    item.not_for, item.not_for_until = worker, now + GIVEN_BACK_RESERVE_S
    item.meant_for = pool.planned_moves.get(worker, {}).pop(request_id, None)
    item.num_moves += 1
    pool.pending.appendleft(item.item_id)
    pool.last_gave[worker] = now
    pool.counters.num_migrated += 1
