"""Work moves where it would queue, not where it would run anyway: an owner starts its own rows
while its engine has room, and another worker takes them only beyond that (scripted progress,
no model, no Ray)."""

from __future__ import annotations

from batchgen_data.rebalance.core.pool import WorkPool
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.step_model import StepSums


def _rows(lengths: list[int]) -> list[tuple[str, dict]]:
    return [(f"row {i}", {"max_tokens": n}) for i, n in enumerate(lengths)]


def _full(slots: int) -> WorkerProgress:
    """A load report of an engine whose ``slots`` running slots are all taken."""
    seqs = tuple(SeqProgress(10, 256, 10, started=True, movable=True, running=True) for _ in range(slots))
    return WorkerProgress(slots=slots, seqs=seqs, step=StepSums(), move_s_per_token=1e-4, kv_s_per_token=1e-5,
                          move_latency_s=0.01)


def _long(items) -> list[int]:
    return sorted((item.max_tokens for item in items), reverse=True)


def test_an_owner_with_room_keeps_its_rows_and_the_other_worker_takes_only_what_would_wait():
    pool = WorkPool()
    for w in ("a", "b"):
        pool.register(w, now=0.0, ready=True)
    pool.submit("batch-a", "a", _rows([256] * 4 + [8] * 4), now=1.0)
    assert pool.lease("b", 8, now=1.0) == []  # before a's first lease its engine is empty
    pool.hold("a", 8, now=1.0)  # a's held call asks for its 8 free slots
    assert pool.lease("b", 8, now=1.0) == []
    pool.unhold("a")
    mine = pool.lease("a", 8, now=1.0)
    assert _long(mine) == [256] * 4 + [8] * 4  # all its own rows, no share kept back for b
    # Its next batch finds its engine full (its held call asks for nothing): b takes those rows.
    pool.submit("batch-a2", "a", _rows([8] * 6), now=1.1)
    pool.hold("a", 0, now=1.1)
    taken = pool.lease("b", 8, now=1.1)
    assert len(taken) == 6 and {item.batch_key for item in taken} == {"batch-a2"}
    # With room for 2 of another 6, a keeps its 2 longest and b may take the other 4.
    pool.submit("batch-a3", "a", _rows([16, 16, 8, 8, 8, 8]), now=1.2)
    pool.hold("a", 2, now=1.2)
    assert _long(pool.lease("b", 8, now=1.2)) == [8] * 4


def test_a_reported_full_engine_leaves_its_queued_rows_to_an_idle_worker_longest_first():
    # The queued skew: 16 long rows in one owner's batch, 8 running slots per engine.
    pool = WorkPool()
    for w in ("a", "b"):
        pool.register(w, now=0.0, ready=True)
    pool.submit("batch-a", "a", _rows([256] * 16 + [8] * 16), now=1.0)
    first = pool.lease("a", 8, now=1.0)
    assert _long(first) == [256] * 8
    pool.lease("a", 0, now=1.2, progress=_full(8))  # its report: every slot taken
    second = pool.lease("b", 8, now=1.3)
    assert _long(second) == [256] * 8  # the long rows that would have queued behind a's set


def test_rows_of_a_silent_owner_go_to_whoever_has_room():
    pool = WorkPool(lease_timeout_s=5.0)
    pool.register("a", now=0.0, ready=True)
    pool.submit("batch-a", "a", _rows([64] * 4), now=0.0)
    assert pool.lease("b", 8, now=1.0) == []  # a is alive and has room
    assert len(pool.lease("b", 8, now=10.0)) == 4  # a has not been heard from for a lease timeout


def test_rows_an_owner_runs_outside_the_pool_count_in_the_shares():
    # The owner started its 8 longest rows on its own engine before the stage had a pool and put
    # the other 8 in it: the pool sees those 8 only in its load report.
    pool = WorkPool()
    for w in ("a", "b"):
        pool.register(w, now=0.0, ready=True)
    seqs = tuple(SeqProgress(0, 256, 10, started=True, movable=False) for _ in range(8))
    report = WorkerProgress(slots=8, seqs=seqs, step=StepSums(), move_s_per_token=1e-4, kv_s_per_token=1e-5,
                            move_latency_s=0.01, local_tokens=8 * 257)
    pool.submit("batch-a", "a", _rows([256] * 8), now=0.0)
    assert pool.lease("a", 0, now=0.0, progress=report) == []  # full
    # b's share is half of all 16 long rows, not half of the 8 in the pool: it takes all 8.
    assert _long(pool.lease("b", 8, now=0.1)) == [256] * 8
