"""The work pool starts on demand (``rebalance/core/local_first.py``, ``RebalanceClient.run_batch``):
rows that fit their engine run there with no coordinator; a batch with rows that would queue
starts one, runs its longest rows that fit at once and pools the rest (real demo engine,
in-process coordinator, no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.rebalance.core.local_first import EngineRoom, full_length, rows_here
from batchgen_data.rebalance.transport import InProcessTransport

pytestmark = pytest.mark.timeout(120)


def test_rows_here_are_the_longest_that_fit_the_free_slots_and_kv():
    lengths = [300, 20, 310, 20, 40]
    assert rows_here(lengths, EngineRoom(slots=8, kv_tokens=10_000)) == [0, 1, 2, 3, 4]  # all fit
    assert rows_here(lengths, EngineRoom(slots=2, kv_tokens=10_000)) == [0, 2]  # the two longest
    assert rows_here(lengths, EngineRoom(slots=8, kv_tokens=400)) == [1, 2, 3, 4]  # 310 + 40 + 20 + 20
    assert rows_here(lengths, EngineRoom(slots=0, kv_tokens=10_000)) == []
    assert full_length("x" * 40, 16) == 40 // 4 + 1 + 16


def test_a_batch_runs_on_its_engine_until_rows_would_queue_then_the_pool_takes_the_rest(demo_path, monkeypatch):
    import batchgen_data.rebalance.client.client as rebalance

    from batchgen_data.engine.async_engine import AsyncEngine
    from batchgen_data.operators.rebalance import stage_client
    from batchgen_data.rebalance.coordinator import Coordinator

    coordinator = Coordinator(lease_timeout_s=5.0)
    started = []

    def start(name, lease_timeout_s):
        started.append(name)
        return InProcessTransport(coordinator)

    monkeypatch.setattr(rebalance, "start_pool", start)
    pooled = []
    submit = coordinator.pool.submit
    monkeypatch.setattr(coordinator.pool, "submit", lambda key, owner, rows, now=0.0: (pooled.extend(rows),
                                                                                        submit(key, owner, rows, now)))
    config = EngineConfig(max_num_seqs=8)
    prompts = [f"Row {i}: the parcel went to the wrong door." for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(12)]
    expected = [o.token_ids for o in Engine(demo_path, config).generate(prompts, params)]

    async def job():
        client = stage_client(AsyncEngine(Engine(demo_path, config)), "stage", 5.0, calibrate=False, max_calls=2)
        first = await client.run_batch(prompts[:8], params[:8])  # 8 rows, 8 free slots: all here
        assert not started and client.stats.num_local_batches == 1
        second = await client.run_batch(prompts, params)  # 12 rows: 4 would queue
        # The 4 shortest went to the pool (the longest start at once), and came back in row order.
        assert started and [params["max_tokens"] for _, params in pooled] == [4, 6, 8, 10]
        # Its load reports carry its open calls and call slots (the pool's ``pacing`` reads them).
        report = coordinator.pool.loads[client.state.worker_id].progress
        assert (report.calls, report.max_calls) == (1, 2)
        for task in client.background_tasks():
            task.cancel()
        return first, second

    first, second = asyncio.run(job())
    assert [list(r.values["generated_tokens"]) for r in first] == expected[:8]
    assert [list(r.values["generated_tokens"]) for r in second] == expected
