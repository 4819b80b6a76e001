"""The work pool's records: a batch, a worker's last load report, a lease, and the counters; and
the stage's step model over the alive workers' reports (``pooled_step_model``) and the items a
worker was leased since its report (``leased_since``). Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.rebalance.core.progress import WorkerProgress
from batchgen_data.rebalance.core.step_model import StepModel, StepSums


@dataclass(slots=True)
class Batch:
    owner: str
    item_ids: list[str]


@dataclass(slots=True)
class Load:
    progress: WorkerProgress  # the worker's last load report
    seen: float
    leased_since: list = field(default_factory=list)  # items leased to it with or after that report
    tokens_left: float | None = None  # its sequences' tokens left by that report (``tail``: computed once)
    local_rows: int = 0  # its movable rows outside the pool by that report (``WorkPool.set_load``)


@dataclass(slots=True)
class Lease:
    worker: str
    deadline: float


@dataclass(slots=True)
class PoolCounters:
    num_submitted: int = 0
    num_completed: int = 0
    num_moved: int = 0  # completed by a worker other than the owner
    num_requeued: int = 0  # leases returned after a worker death or expiry (work redone)
    num_duplicates_dropped: int = 0
    num_migrated: int = 0  # sequences given back at the tail, to be continued elsewhere
    num_adopted: int = 0  # of them, rows run outside the pool that entered it as they moved (``moved.adopt``)
    num_moves_planned: int = 0  # sequences the tail plans named (each one is given back)
    num_moves_declined: int = 0  # tail plans whose estimated gain missed the margin (nothing moved)
    num_batches_dropped: int = 0  # batches whose waiter was gone (caller gave up, owner dead)
    num_members_at_first_lease: int = 0  # how many workers the pool's first lease shared the work over
    leased_by_worker: dict = field(default_factory=dict)


def pooled_step_model(step_total: StepSums, loads: dict[str, Load], alive) -> StepModel | None:
    """The stage's step model: the alive workers' calibrated lines at their measured level (the
    pool's running total of every recorded report's ``StepSums``, less the workers not in
    ``alive``)."""
    pooled = step_total
    for worker, load in loads.items():
        if worker not in alive:
            pooled = pooled.minus(load.progress.step)
    return pooled.fit()


def leased_since(load: Load, leases: dict[str, Lease], worker: str) -> list:
    """The items leased to ``worker`` with or after its last report that are still its (not in
    its engine when it reported; those it finished or gave back since are gone)."""
    return [item for item in load.leased_since
            if (lease := leases.get(item.item_id)) is not None and lease.worker == worker]
