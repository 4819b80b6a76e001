"""Pacing (``rebalance/core/pacing.py``): a worker holding a row long for the job runs a small set
beside it, by the projected end of the stage; worked by hand, through the pool, and in the
simulator against the same core with pacing off."""

from __future__ import annotations

import pytest

from batchgen_data.rebalance.core import pacing
from batchgen_data.rebalance.core.projection import running_cap, stage_end_s
from batchgen_data.rebalance.core.pool import WorkPool
from batchgen_data.rebalance.core.progress import WorkerProgress
from batchgen_data.rebalance.core.step_model import StepModel, StepSums
from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.run import SimConfig, simulate
from batchgen_data.rebalance.simulate.scenario import Row

MODEL = StepModel(0.01, 0.001)  # a step: 10 ms, and 1 ms a running sequence


def test_the_cap_is_the_largest_set_whose_steps_end_the_row_in_time():
    assert running_cap(1000, 20.0, MODEL, 64) == 10  # 20 ms a step: 10 + 1 x 10 ms
    assert running_cap(1000, 20.5, MODEL, 64) == 10  # 20.5 ms: 10 still, not 10.5
    assert running_cap(1000, 5.0, MODEL, 64) == 1  # it cannot end in time even alone: alone
    assert running_cap(10, 20.0, MODEL, 64) == 64  # short for the time left: a full set
    assert running_cap(1000, 20.0, StepModel(0.03, 0.0, is_slope_known=False), 64) == 64


def test_the_projected_end_is_the_longest_row_alone_or_the_work_at_paced_throughput():
    # Two workers of 10 slots: 10 / 20 ms = 500 tokens a second each at full sets.
    assert stage_end_s([(0, 10), (0, 10)], 4000, MODEL) == pytest.approx(4.0)
    # A 1,000-token row alone takes 1,000 x 11 ms; the other worker makes the 4,000 tokens by then.
    assert stage_end_s([(1000, 10), (0, 10)], 4000, MODEL, max_paced=1) == pytest.approx(11.0)
    # 20,000 tokens: at 20 s the paced worker runs 10 (20 ms steps) and both make 500 a second;
    # at 19 s it could run only 9, and they make 973.7 a second: 18,500 tokens, short.
    end = stage_end_s([(1000, 10), (0, 10)], 20_000, MODEL, max_paced=1)
    assert 19.0 < end <= 20.0


def _pool_with_one_long_row(max_calls: int | None) -> WorkPool:
    """One owner's batch: a 2,000-token row and 200 of 10 tokens, four workers of 16 slots
    reporting, their call slots (``max_calls``) free or not known."""
    pool = WorkPool()
    pool.submit("b", "w1", [("long", {"max_tokens": 2000})] + [(f"short {i}", {"max_tokens": 10}) for i in range(200)])
    sums = StepSums()
    sums.calibrate(MODEL)
    for worker in ("w1", "w2", "w3", "w4"):
        pool.lease(worker, 0, 0.0, WorkerProgress(16, (), sums, calls=1, max_calls=max_calls))
    return pool


def test_a_worker_that_takes_a_long_row_runs_only_the_set_it_allows():
    # Full sets: the long row's 2,000 steps at 26 ms take 52 s, where the short rows take ~1 s of
    # four workers' full sets. Paced, the stage ends when the long row does alone: 2,000 steps of
    # 11 ms, 22 s; a second sequence beside it (12 ms steps) would make that 24 s.
    pool = _pool_with_one_long_row(max_calls=2)
    taken = pool.lease("w1", 16, 0.1)
    assert [item.params["max_tokens"] for item in taken] == [2000]
    assert len(pool.lease("w2", 16, 0.1)) == 16  # no long row: a full set
    assert pool.lease("w1", 16, 0.2) == []  # at its cap


def test_nothing_is_paced_while_the_input_may_still_be_coming():
    # Every actor runs as many calls as it may (or says nothing of them): Ray Data may hold more
    # blocks for them, the work ahead is not known, and a projected end would come too soon.
    for max_calls in (1, None):
        pool = _pool_with_one_long_row(max_calls=max_calls)
        assert len(pool.lease("w1", 16, 0.1)) == 16


def _scenario() -> list[Row]:
    """2,000 rows of 40-120 tokens (~40 s of full sets on four actors) and four of 4,000 among
    the last (33 s alone, 208 s in a full set), in 32 blocks: all in at once."""
    rows = [Row(64, 40 + (i * 7) % 81, 40 + (i * 7) % 81) for i in range(2000)]
    for k in (1200, 1400, 1600, 1800):
        rows[k] = Row(64, 4000, 4000)
    return rows


def test_long_rows_end_far_sooner_paced_than_in_full_sets(monkeypatch):
    config = SimConfig(4, max_num_seqs=64, block_rows=64, tasks_in_flight=16, concurrent_calls=16)
    paced = simulate(_scenario(), config, ActorModel())
    monkeypatch.setattr(pacing, "_MIN_GAIN", 0.0)  # no projection is ever that much sooner: pacing off
    full = simulate(_scenario(), config, ActorModel())
    assert paced.makespan_s < 0.9 * full.makespan_s  # measured: 60.2 s against 71.7 s
