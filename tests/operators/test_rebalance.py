"""Rebalancing across real engines: rows that would queue on one operator actor go to the stage's
pool, started on demand; a tail left on one engine is split with another (PARTITION) and moved sequences
continue where they stopped (MIGRATE); every row comes out exactly once with the same text as a
run on one engine (real local Ray, bounded in time)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from batchgen_data import BatchGenOperator, Engine, EngineConfig, SamplingParams
from batchgen_data.rebalance.transport import InProcessTransport

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)

ENGINE_CONFIG = {"max_num_seqs": 8, "attention_batch_size": 8, "max_num_batched_tokens": 512}
# KV memory for ~720 tokens: the eight long rows (~180 tokens each at the end) do not all fit, so
# the engine that runs them suspends some once they grow, and those wait for memory: a queue that
# moving pays for under any step model (the rebalancing decision does not hinge on timing noise).
KV_TOKENS = 720


def _engine_config(demo_path) -> dict:
    from batchgen_data.model.kv_cache import KVCache
    from batchgen_data.model import MoEModel

    block_size = EngineConfig().block_size
    per_block = KVCache.bytes_per_block(MoEModel.from_pretrained(demo_path).kv_specs, block_size)
    return {**ENGINE_CONFIG, "kv_cache_memory_bytes": per_block * (KV_TOKENS // block_size)}


def _rows() -> list[dict]:
    # Two blocks: eight long rows, then eight shorter ones of 8 to 64 tokens (the long rows
    # clustered at the front, the workload).
    return [{"id": i, "prompt": f"Ticket {i}: the courier left parcel {i * 7} at the wrong door.",
             "sampling_params": {"max_tokens": 160 if i < 8 else 8 * (i - 7), "ignore_eos": True}}
            for i in range(16)]


def _reference(demo_path, rows, engine_config: dict) -> dict[int, list[int]]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the fractional-CPU actors (see fault_helpers.reference_texts)
    try:
        engine = Engine(demo_path, EngineConfig(**engine_config))
        outs = engine.generate([r["prompt"] for r in rows],
                               [SamplingParams(temperature=0.0, **r["sampling_params"]) for r in rows])
    finally:
        torch.set_num_threads(threads)
    return {r["id"]: o.token_ids for r, o in zip(rows, outs)}


def test_long_rows_that_would_queue_go_to_the_pool_and_come_out_once(ray_cluster, demo_path, tmp_path):
    """Eight long rows outgrow their engine's KV memory: their actor starts those that fit and
    puts the rest in the stage's pool, which it starts; every row comes out once with the text
    one engine gives it, and the pool planned exactly what the actors moved."""
    rows = _rows()
    engine_config = _engine_config(demo_path)
    expected = _reference(demo_path, rows, engine_config)
    out = ray.data.from_items(rows, override_num_blocks=2).map_batches(
        BatchGenOperator,
        fn_constructor_kwargs={"model": str(demo_path), "engine_config": engine_config, "rebalance": True,
                               "stats_dir": str(tmp_path)},
        batch_size=8,
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=1, max_tasks_in_flight_per_actor=1),
        num_cpus=0.5,
    ).take_all()
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]  # every row exactly once
    assert {r["id"]: list(r["generated_tokens"]) for r in out} == expected
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("actor-*.json")]
    assert len(reports) == 2, "both actors should have taken part"
    # Each actor calibrated its step model (the slope is a timing: two actors calibrating side by
    # side on two busy cores can measure it flat, so only a step's time is checked).
    assert all(r["rebalance"]["calibrated_base_s"] + r["rebalance"]["calibrated_per_seq_s"] > 0 for r in reports)
    # The pool planned exactly what the actors moved (each plan names its sequences, and the
    # giving engine exports those), and actors with room waited in held calls, not polls.
    [pool] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("batchgen-pool-")]
    counters = ray.get(ray.get_actor(pool["name"], namespace=pool["namespace"]).counters.remote())
    assert counters["num_moves_planned"] == counters["num_migrated"] == sum(r["rebalance"]["num_given_back"]
                                                                              for r in reports)
    assert counters["num_lease_calls"] < 200
    # The eight long rows outgrow their engine's KV memory: their actor started the pool with
    # those that fit and the rest in it (``local_first.rows_here``).
    assert counters["num_submitted"] >= 4


def _rebalance_client(demo_path, coordinator, engine_config: dict = ENGINE_CONFIG):
    """One operator actor's rebalancing client over an in-process pool (no Ray Data); build it in
    the running event loop (it registers with the pool)."""
    from batchgen_data.engine.async_engine import AsyncEngine
    from batchgen_data.operators.rebalance import stage_client

    engine = AsyncEngine(Engine(demo_path, EngineConfig(**engine_config)))
    return stage_client(engine, "test-stage", 5.0, InProcessTransport(coordinator)), engine


def test_tail_sequences_move_between_engines_and_continue_exactly(ray_cluster, demo_path):
    """One engine takes all eight long rows while it is the only member of the stage; a second
    one joins with room once they run: the pool has it take some of them over at the tail, and
    the moved rows continue where they stopped."""
    import torch

    from batchgen_data.rebalance.coordinator import Coordinator

    rows = _rows()
    engine_config = _engine_config(demo_path)
    expected = _reference(demo_path, rows, engine_config)
    coordinator = Coordinator(lease_timeout_s=5.0)
    pool = coordinator.pool

    def params(batch):
        return [SamplingParams(temperature=0.0, **r["sampling_params"]) for r in batch]

    async def job():
        first, first_engine = _rebalance_client(demo_path, coordinator, engine_config)
        long_rows, short_rows = rows[:8], rows[8:]
        first_call = asyncio.ensure_future(first.run_batch([r["prompt"] for r in long_rows], params(long_rows)))
        started = time.monotonic()
        while len(pool.leases) < 8 and time.monotonic() - started < 60.0:
            await asyncio.sleep(0.02)  # until the first engine holds them all (bounded)
        assert len(pool.leases) == 8
        second, second_engine = _rebalance_client(demo_path, coordinator, engine_config)
        second_call = second.run_batch([r["prompt"] for r in short_rows], params(short_rows))
        try:
            return await asyncio.gather(first_call, second_call), second
        finally:
            first_engine.shutdown()
            second_engine.shutdown()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference (``_reference``) and the fractional-CPU actors
    try:
        (first_results, second_results), second = asyncio.run(job())
    finally:
        torch.set_num_threads(threads)
    assert _tokens(first_results) + _tokens(second_results) == [expected[r["id"]] for r in rows]
    assert pool.counters.num_migrated > 0 and second.stats.num_continued > 0  # moved, and finished there
    assert pool.counters.num_moves_planned == pool.counters.num_migrated
    assert not (pool.batches or pool.items or pool.results)


def test_rows_run_before_the_pool_started_move_at_the_tail_and_come_out_once(ray_cluster, demo_path, monkeypatch):
    """The first engine runs its eight long rows on its own (no pool yet: they would fit its free
    slots); another actor then starts the stage's pool and soon has nothing to run. The first
    finds the pool while its rows run (``_watch_for_pool``), its rows are movable from then on,
    and the pool has the second engine take some of them at the tail: they enter the pool as they move (``WorkPool.adopt``), continue
    where they stopped, and each row comes out once, as on one engine."""
    import torch

    import batchgen_data.rebalance.client.client as rebalance
    from batchgen_data.operators.rebalance import stage_client
    from batchgen_data.rebalance.coordinator import Coordinator

    # The second actor's rows are short (4 tokens): its own call ends long before the first's
    # rows do, and it must keep that call open to receive them (``WorkPool.outstanding`` counts
    # rows run outside the pool); without that, nothing could move to it.
    rows = [r if r["id"] < 8 else dict(r, sampling_params={"max_tokens": 4, "ignore_eos": True}) for r in _rows()]
    engine_config = _engine_config(demo_path)
    expected = _reference(demo_path, rows, engine_config)
    coordinator = Coordinator(lease_timeout_s=5.0)
    pool = coordinator.pool
    pool_started = []
    monkeypatch.setattr(rebalance, "find_pool",
                        lambda name: InProcessTransport(coordinator) if pool_started else None)
    monkeypatch.setattr(rebalance, "rows_here", lambda lengths, room: list(range(len(lengths))))  # all here

    def params(batch):
        return [SamplingParams(temperature=0.0, **r["sampling_params"]) for r in batch]

    async def job():
        from batchgen_data.engine.async_engine import AsyncEngine

        first_engine = AsyncEngine(Engine(demo_path, EngineConfig(**engine_config)))
        first = stage_client(first_engine, "test-stage", 5.0)
        long_rows, short_rows = rows[:8], rows[8:]
        second_engine = None
        try:
            first_call = asyncio.ensure_future(first.run_batch([r["prompt"] for r in long_rows], params(long_rows)))
            started = time.monotonic()
            while len(first.probe.snapshot.progress.seqs) < 8 and time.monotonic() - started < 60.0:
                await asyncio.sleep(0.02)  # until its engine holds them all (bounded)
            assert first.stats.num_local_batches == 1 and first.state.pool is None and not pool.items
            pool_started.append(True)  # another actor of the stage started the pool
            second, second_engine = _rebalance_client(demo_path, coordinator, engine_config)
            second_call = second.run_batch([r["prompt"] for r in short_rows], params(short_rows))
            return await asyncio.gather(first_call, second_call), first, second
        finally:
            first_engine.shutdown()
            if second_engine is not None:
                second_engine.shutdown()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference (``_reference``) and the fractional-CPU actors
    try:
        (first_results, second_results), first, second = asyncio.run(job())
    finally:
        torch.set_num_threads(threads)
    assert _tokens(first_results) + _tokens(second_results) == [expected[r["id"]] for r in rows]
    assert pool.counters.num_adopted > 0 and first.stats.num_adopted == pool.counters.num_adopted
    # Each continued from its exported state: on the receiver the plan chose, or, where that one
    # had no slot free within the reserve (two engines share this process's cores), back here.
    assert first.stats.num_continued + second.stats.num_continued == pool.counters.num_migrated
    assert pool.counters.num_moves_planned == pool.counters.num_migrated
    assert not (pool.batches or pool.items or pool.results)


def _tokens(results) -> list[list[int]]:
    return [list(r.values["generated_tokens"]) for r in results]


def test_equal_batches_of_two_calls_get_their_own_samples(ray_cluster, demo_path):
    """Two calls with the same rows (unseeded, sampled) are two batches: each gets samples of
    its own, not a copy of the other's."""
    from batchgen_data.rebalance.coordinator import Coordinator

    coordinator = Coordinator(lease_timeout_s=5.0)
    pool = coordinator.pool
    prompts = ["Write one line about a parcel."] * 4
    params = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True) for _ in prompts]

    async def job():
        client, engine = _rebalance_client(demo_path, coordinator)
        try:
            return await asyncio.gather(client.run_batch(prompts, params), client.run_batch(prompts, params))
        finally:
            engine.shutdown()

    first, second = asyncio.run(job())
    assert pool.counters.num_submitted == 8  # two entries in the pool, not one shared
    assert _tokens(first) != _tokens(second)
    assert not (pool.batches or pool.items or pool.results)


def test_a_cancelled_call_leaves_nothing_in_the_pool(ray_cluster, demo_path):
    """A batch whose caller was cancelled mid-run: its items and results leave the pool (nobody
    will ever take them), while the work already running finishes and is dropped."""
    from batchgen_data.rebalance.coordinator import Coordinator

    coordinator = Coordinator(lease_timeout_s=5.0)
    pool = coordinator.pool
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in range(4)]

    async def job():
        client, engine = _rebalance_client(demo_path, coordinator)
        try:
            await run(client)
        finally:
            engine.shutdown()

    async def run(client):
        call = asyncio.ensure_future(client.run_batch([f"Row {i}: a long note." for i in range(4)], params))
        started = time.monotonic()
        while not pool.leases and not call.done() and time.monotonic() - started < 60.0:
            await asyncio.sleep(0.02)  # until submitted and running (bounded: never hang the suite)
        assert pool.leases and not call.done(), "the batch should be leased and running when cancelled"
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        deadline = time.monotonic() + 10.0
        while (pool.batches or pool.items or pool.results) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(job())
    assert not (pool.batches or pool.items or pool.results or pool.pending)
    assert pool.counters.num_batches_dropped == 1


def test_the_stage_pool_starts_only_when_rows_would_queue(ray_cluster, demo_path):
    """Rows that fit their actor's engine run there, with no coordinator process at all; a batch
    with more rows than its engine has running slots starts the stage's pool, which runs the
    rows that would have queued (issue #33: a coordinator started as the actors load delayed
    their first step by 0.4-0.6 s on 2 cores, where nothing could be gained)."""
    from batchgen_data.rebalance.ray_actor import find_coordinator
    from batchgen_data.rebalance.client.membership import stage_coordinator_name
    from batchgen_data.operators.rows import StageConfig

    kwargs = {"model": str(demo_path), "engine_config": ENGINE_CONFIG, "max_tokens": 4, "ignore_eos": True}
    name = stage_coordinator_name(repr(StageConfig.from_kwargs(**kwargs)))

    def run(num_rows: int, block: int) -> None:
        rows = [{"id": i, "prompt": f"Row {i}"} for i in range(num_rows)]
        out = ray.data.from_items(rows, override_num_blocks=num_rows // block).map_batches(
            BatchGenOperator, fn_constructor_kwargs={**kwargs, "rebalance": True}, batch_size=block,
            compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=1), num_cpus=0.5,
        ).take_all()
        assert sorted(r["id"] for r in out) == list(range(num_rows))  # every row exactly once

    run(8, 4)  # blocks of 4 rows, 8 running slots per engine
    assert find_coordinator(name) is None
    try:
        run(24, 12)  # 12 rows a block: 4 would queue behind an engine's 8 slots
        coordinator = find_coordinator(name)
        assert coordinator is not None
        counters = ray.get(coordinator.counters.remote())
        assert counters["num_submitted"] >= 4 and counters["num_completed"] == counters["num_submitted"]
    finally:
        if (coordinator := find_coordinator(name)) is not None:
            ray.kill(coordinator)
