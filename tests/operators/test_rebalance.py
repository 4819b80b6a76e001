"""Rebalancing across two real operator actors: the tail is split between them (PARTITION) and
moved sequences continue where they stopped (MIGRATE), with every row exactly once and the same
text as a run on one engine (real local Ray, bounded in time)."""

from __future__ import annotations

import json

import pytest

from batchgen_data import BatchGenOperator, Engine, EngineConfig, SamplingParams

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
    # Two blocks: eight long rows, then eight shorter ones of 8 to 64 tokens. The actor that gets
    # the long block leases all of it while it is the only active one; the other one's rows are
    # done first, and from then on the pool has nothing pending, while the long rows' engine
    # holds more than its KV memory runs at once: the tail is worth splitting.
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


def test_tail_sequences_move_between_actors_and_continue_exactly(ray_cluster, demo_path, tmp_path):
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
    stats = [json.loads(p.read_text())["rebalance"] for p in tmp_path.glob("actor-*.json")]
    assert len(stats) == 2, "both actors should have taken part"
    assert sum(s["num_given_back"] for s in stats) > 0  # started rows moved, at the tail
    assert sum(s["num_continued"] for s in stats) > 0  # and were finished by the other actor
    # The pool planned exactly what the actors moved: each plan names its sequences, and the
    # giving engine exports those.
    [pool] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("batchgen-pool-")]
    counters = ray.get(ray.get_actor(pool["name"], namespace=pool["namespace"]).counters.remote())
    assert counters["num_moves_planned"] == counters["num_migrated"] == sum(s["num_given_back"] for s in stats)


class _InProcess:
    """A ``Coordinator`` in this process behind the ``handle.method.remote(...)`` calls a Ray
    actor handle takes, so a test can look into its pool."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def __getattr__(self, name: str):
        import asyncio
        from types import SimpleNamespace

        method = getattr(self.coordinator, name)
        return SimpleNamespace(remote=lambda *args: asyncio.ensure_future(method(*args)))


def _rebalance_client(demo_path):
    """One operator actor's rebalancing client over an in-process pool (no Ray Data)."""
    from batchgen_data.distributed.coordinator import Coordinator
    from batchgen_data.engine.async_engine import AsyncEngine
    from batchgen_data.operators.rebalance import RebalanceClient

    handle = _InProcess(Coordinator(lease_timeout_s=5.0))
    engine = AsyncEngine(Engine(demo_path, EngineConfig(**ENGINE_CONFIG)))
    return RebalanceClient(engine, "test-stage", 5.0, handle), handle.coordinator.pool, engine


def _tokens(results) -> list[list[int]]:
    return [list(r.values["generated_tokens"]) for r in results]


def test_equal_batches_of_two_calls_get_their_own_samples(ray_cluster, demo_path):
    """Two calls with the same rows (unseeded, sampled) are two batches: each gets samples of
    its own, not a copy of the other's."""
    import asyncio

    client, pool, engine = _rebalance_client(demo_path)
    prompts = ["Write one line about a parcel."] * 4
    params = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True) for _ in prompts]

    async def job():
        return await asyncio.gather(client.run_batch(prompts, params), client.run_batch(prompts, params))

    try:
        first, second = asyncio.run(job())
    finally:
        engine.shutdown()
    assert pool.counters.num_submitted == 8  # two entries in the pool, not one shared
    assert _tokens(first) != _tokens(second)
    assert not (pool.batches or pool.items or pool.results)


def test_a_cancelled_call_leaves_nothing_in_the_pool(ray_cluster, demo_path):
    """A batch whose caller was cancelled mid-run: its items and results leave the pool (nobody
    will ever take them), while the work already running finishes and is dropped."""
    import asyncio
    import time

    client, pool, engine = _rebalance_client(demo_path)
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in range(4)]

    async def job():
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

    try:
        asyncio.run(job())
    finally:
        engine.shutdown()
    assert not (pool.batches or pool.items or pool.results or pool.pending)
    assert pool.counters.num_batches_dropped == 1
