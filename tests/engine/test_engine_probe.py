"""What rebalancing reads about an engine comes as one immutable snapshot per step: a reader on
another thread never sees one step's counts beside another's (no model needed)."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest

from batchgen_data.engine.migration.engine_probe import EngineProbe, ProbeSnapshot
from batchgen_data.rebalance.core.step_model import StepSums
from batchgen_data.engine.step_report import StepReport


def _engine():
    """What the probe reads of an ``AsyncEngine`` (its accepted count, its engine's rates)."""
    stats = SimpleNamespace(num_forward_tokens=1000, kernel_s=1.0, busy_s=2.0, num_forwards=100)
    return SimpleNamespace(num_accepted=3, engine=SimpleNamespace(kv_bytes_per_token=64, stats=lambda: stats))


def _report(num_running: int = 4, step_s: float = 0.01) -> StepReport:
    return StepReport(num_running=num_running, num_queued=0, num_tokens=num_running, num_sampled=num_running,
                      step_s=step_s)


def test_the_snapshot_is_frozen_and_replaced_whole_after_every_step():
    probe, engine = EngineProbe(), _engine()
    for _ in range(12):  # past the step model's warm-up
        probe(engine, _report(), {})
    held = probe.snapshot
    sums = dataclasses.astuple(held.step)
    with pytest.raises(dataclasses.FrozenInstanceError):
        held.step = StepSums()  # type: ignore[misc]
    probe(engine, _report(num_running=8), {})
    assert probe.snapshot is not held and probe.snapshot.step is not held.step
    assert dataclasses.astuple(held.step) == sums  # what a reader holds never changes under it
    assert probe.snapshot.step.w > held.step.w and probe.snapshot.progress.num_accepted == 3
    assert held.move_s_per_token > 0 and isinstance(held, ProbeSnapshot)


def test_a_reader_on_another_thread_never_sees_a_torn_step():
    """With every step at n running and s seconds, every consistent set of sums has
    t == s * w and nt == n * t; a read between the updates of the sums would not."""
    probe, engine = EngineProbe(), _engine()
    n, s = 4, 0.01
    done, torn = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            sums = probe.snapshot.step
            if sums.w and not (sums.t == pytest.approx(s * sums.w) and sums.nt == pytest.approx(n * sums.t)):
                torn.append(sums)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(5000):
            probe(engine, _report(n, s), {})
    finally:
        done.set()
        reader.join()
    assert not torn
    assert probe.snapshot.step.fit().step_s(n) == pytest.approx(s)


def _live(request_id: int, status, generated: int = 3, max_tokens: int = 16):
    from batchgen_data.engine.core.progress import RequestProgress

    progress = RequestProgress(request_id, status, generated, max_tokens, 10 + generated)
    return SimpleNamespace(handle=SimpleNamespace(progress=progress), movable=True, in_pool=True)


def test_the_snapshot_is_the_live_requests_of_one_step_read_when_asked():
    """Publishing after every step keeps the live requests and the accepted count (no per-request
    work on the engine thread); the reader builds their progress when it asks, each request from
    its one latest record, running ones first, and a request that finished since reads as gone."""
    from batchgen_data.engine.core.sequence import SequenceStatus
    from batchgen_data.rebalance.core.step_model import StepModel

    probe, engine = EngineProbe(), _engine()
    probe.calibrate(StepModel(0.01, 0.002))
    live = {0: _live(0, SequenceStatus.WAITING), 1: _live(1, SequenceStatus.RUNNING),
            2: _live(2, SequenceStatus.RUNNING)}
    probe(engine, _report(num_running=2), live)
    snapshot = probe.snapshot
    assert [s.request_id for s in snapshot.progress.seqs] == [1, 2, 0] and snapshot.progress.num_accepted == 3
    assert snapshot.step.calibrated == StepModel(0.01, 0.002)
    live[2].handle.progress = dataclasses.replace(live[2].handle.progress, status=SequenceStatus.FINISHED)
    assert [s.request_id for s in snapshot.progress.seqs] == [1, 0]  # its slot is free
