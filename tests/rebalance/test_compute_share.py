"""An idle worker takes waiting rows, or a busy one's tail, only where that adds compute: engines
on one machine's CPUs beside busy ones only take turns with them (``distributed/compute.py``;
scripted reports, no model, no Ray)."""

from __future__ import annotations

from batchgen_data.hardware import ComputeShare
from batchgen_data.rebalance.core.compute import adds_compute, joining
from batchgen_data.rebalance.core.pool import WorkPool
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.step_model import StepModel, StepSums

_CPU = ComputeShare("node-1", cpu_threads=1, node_cpus=2)  # the skew grid's actors: 1 thread, 2 cores


def test_a_worker_adds_compute_while_its_machines_cpus_have_room_for_its_threads():
    shares = {w: _CPU for w in "abc"}
    assert adds_compute("c", shares, busy={"a"}) and not adds_compute("c", shares, busy={"a", "b"})
    assert adds_compute("c", shares, busy={"a", "b", "c"})  # busy itself: it adds no process
    elsewhere = {**shares, "c": ComputeShare("node-2", 1, 2)}
    assert adds_compute("c", elsewhere, busy={"a", "b"})
    on_gpu = {**shares, "c": ComputeShare("node-1", cpu_threads=0, node_cpus=2)}
    assert adds_compute("c", on_gpu, busy={"a", "b"})  # its steps run on a device of its own
    assert adds_compute("c", {"a": _CPU, "b": _CPU}, busy={"a", "b"})  # not known: not held back
    wide = {w: ComputeShare("node-1", cpu_threads=2, node_cpus=4) for w in "abc"}
    assert joining(["b", "c"], wide, busy={"a"}) == {"b"}  # 2 + 2 threads fill the 4 CPUs
    assert joining(["a", "b", "c"], shares, busy=set()) == {"a", "b"}


def _report(running: int, compute: ComputeShare, slots: int = 8) -> WorkerProgress:
    steps = StepSums()
    steps.calibrate(StepModel(0.008, 0.003))  # each running sequence adds 3 ms to a step
    seqs = tuple(SeqProgress(20, 256, 40, True, request_id=i) for i in range(running))
    return WorkerProgress(slots, seqs, steps, move_s_per_token=1e-5, move_latency_s=0.05, compute=compute)


def _rows(n: int, max_tokens: int) -> list[tuple[str, dict]]:
    return [(f"row {i}", {"max_tokens": max_tokens}) for i in range(n)]


def test_an_idle_actor_takes_queued_rows_only_where_its_cpus_are_idle():
    # Three 1-thread actors on 2 cores: b runs 8 short rows, a 8 long ones with 8 more queued.
    pool = WorkPool()
    pool.submit("short", "b", _rows(8, 16), now=0.0)
    assert len(pool.lease("b", 8, now=0.0, progress=_report(0, _CPU, slots=16))) == 8
    pool.submit("long", "a", _rows(16, 256), now=0.0)
    assert len(pool.lease("a", 8, now=0.0, progress=_report(0, _CPU))) == 8  # 8 more queue there
    # c, idle, would only take turns with a and b on the two cores: it takes nothing ...
    assert pool.lease("c", 8, now=0.2, progress=_report(0, _CPU)) == []
    # ... and b's share of the queued rows is taken over a and b (4,248 tokens / 2, less the 136
    # it holds: 7 long rows), not over all three (4 rows).
    assert len(pool.lease("b", 8, now=0.3, progress=_report(8, _CPU, slots=16))) == 7
    for item_id in [i for i, lease in pool.leases.items() if lease.worker == "b"]:
        pool.complete("b", item_id, "r")  # b is done: a core is idle now
    assert len(pool.lease("c", 8, now=0.4, progress=_report(0, _CPU))) == 1  # the last queued row
    # On accelerators of their own (no CPU threads to share) c takes its share at once: a third
    # of the outstanding 4,248 tokens, 5 long rows.
    gpu = ComputeShare("node-1", cpu_threads=0, node_cpus=2)
    pool = WorkPool()
    pool.submit("short", "b", _rows(8, 16), now=0.0)
    pool.lease("b", 8, now=0.0, progress=_report(0, gpu, slots=16))
    pool.submit("long", "a", _rows(16, 256), now=0.0)
    pool.lease("a", 8, now=0.0, progress=_report(0, gpu))
    assert len(pool.lease("c", 8, now=0.2, progress=_report(0, gpu))) == 5


def test_a_busy_actors_tail_moves_only_to_a_receiver_that_adds_compute():
    def tail(receiver_share: ComputeShare, third_busy: bool) -> int:
        pool = WorkPool()
        pool.submit("long", "a", _rows(8, 256), now=0.0)
        pool.lease("a", 8, now=0.0, progress=_report(0, _CPU))
        if third_busy:
            pool.submit("b-own", "b", _rows(8, 256), now=0.0)
            pool.lease("b", 8, now=0.0, progress=_report(0, _CPU))
            pool.lease("b", 0, now=0.5, progress=_report(8, _CPU))
        pool.lease("c", 8, now=0.5, progress=_report(0, receiver_share))  # idle, 8 free slots
        pool.lease("a", 0, now=0.5, progress=_report(8, _CPU))
        return len(pool.plan_give_back("a", now=0.5))

    assert tail(_CPU, third_busy=False) > 0  # a alone on 2 cores: halving its running set pays
    assert tail(_CPU, third_busy=True) == 0  # a and b fill both cores: c would take turns
    assert tail(ComputeShare("node-2", 1, 2), third_busy=True) > 0  # c's own machine
