"""Models larger than memory: an engine with ``weight_memory_bytes`` streams its experts and gives
the same greedy tokens as a resident one, for every architecture and both expert backends."""

from __future__ import annotations

import asyncio

import pytest
from tiny_checkpoints import ALL_ARCHS

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.errors import ConfigError
from batchgen_data.model.moe.streamed_store import StreamedExpertStore

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99], [1, 2, 3, 4] * 5]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
SMALL = dict(max_num_seqs=6, attention_batch_size=2, block_size=8)


def _budgets(engine: Engine) -> tuple[int, int]:
    """(the minimum budget: dense weights + one layer's top-k experts; one with room for two more)."""
    store, config = engine.executor.model.expert_store, engine.executor.model.config
    per_expert = store.nbytes // (len(store.layer_ids()) * config.num_experts)
    minimum = engine.executor.model.dense_weight_bytes + config.num_experts_per_tok * per_expert
    return minimum, minimum + 2 * per_expert


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_streamed_experts_give_the_resident_tokens(tiny_checkpoint, arch):
    folder, _ = tiny_checkpoint(arch)
    resident = Engine(folder, EngineConfig(**SMALL))
    refs = [o.token_ids for o in resident.generate(PROMPTS, GREEDY)]
    minimum, roomier = _budgets(resident)
    # The smallest budget with a KV pool too small for every sequence at once (suspension).
    tight_kv = resident.kv_bytes_per_token * SMALL["block_size"] * 12
    runs = [("native", minimum, tight_kv), ("deepspeed", roomier, None)]
    for backend, budget, kv in runs:
        with Engine(folder, EngineConfig(**SMALL, expert_backend=backend, weight_memory_bytes=budget,
                                         kv_cache_memory_bytes=kv)) as engine:
            assert isinstance(engine.executor.model.expert_store, StreamedExpertStore)
            assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == refs, backend
            stats = engine.stats()
            assert stats.offload.num_misses > 0
            if kv is not None and stats.offload.planned_running_seqs > 1:
                # The plan sizes the running set from fetch and GEMM rates measured at load: on a
                # loaded machine it may run one sequence at a time, which the pool always fits.
                assert stats.num_suspended > 0


def test_concurrent_callers_with_eviction_and_prefetch_get_the_resident_tokens(tiny_checkpoint):
    from batchgen_data.engine.async_engine import AsyncEngine

    folder, _ = tiny_checkpoint("olmoe")  # 8 experts x 3 layers through a pool of 4
    prompts = PROMPTS * 3
    resident = Engine(folder, EngineConfig(**SMALL))
    refs = [o.token_ids for o in resident.generate(prompts, GREEDY)]
    _, roomier = _budgets(resident)
    aengine = AsyncEngine(Engine(folder, EngineConfig(**SMALL, weight_memory_bytes=roomier)))

    async def main():
        third = len(prompts) // 3
        return await asyncio.gather(*(aengine.generate(prompts[i : i + third], GREEDY) for i in range(0, len(prompts), third)))

    try:
        outputs = [o for batch in asyncio.run(main()) for o in batch]
    finally:
        aengine.shutdown()
    assert [o.token_ids for o in outputs] == refs
    offload = aengine.engine.stats().offload
    assert offload.pool_slots == 4 and offload.num_prefetched > 0
    assert offload.num_misses > offload.pool_slots  # experts were evicted and fetched again


def test_offload_stats_and_timeline_account_for_every_byte(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    _, budget = _budgets(Engine(folder, EngineConfig(**SMALL)))
    with Engine(folder, EngineConfig(**SMALL, weight_memory_bytes=budget, collect_timeline=True)) as engine:
        engine.generate(PROMPTS, GREEDY)
        offload = engine.stats().offload
        store = engine.executor.model.expert_store
    assert offload.resident_dense_bytes + offload.pool_bytes <= budget
    assert offload.pool_bytes == offload.pool_slots * store.bytes_per_expert < offload.model_expert_bytes
    assert offload.bytes_fetched == (offload.num_misses + offload.num_prefetched) * store.bytes_per_expert
    assert 0.0 <= offload.hit_rate <= 1.0 and 0.0 <= offload.fetch_overlap <= 1.0
    assert offload.fetch_bytes_per_s > 0 and 1 <= offload.planned_running_seqs <= SMALL["max_num_seqs"]
    assert engine.max_running_seqs == offload.planned_running_seqs
    # Per step: every demand fetch, and the copies that landed within the step (prefetches may
    # also land between steps).
    assert sum(step["expert_misses"] for step in engine.timeline) == offload.num_misses
    assert offload.num_misses * store.bytes_per_expert <= sum(step["fetched_bytes"] for step in engine.timeline)
    assert sum(step["fetched_bytes"] for step in engine.timeline) <= offload.bytes_fetched


@pytest.mark.parametrize("value", [0, -5, True, 1.5e9, "8GB"])
def test_a_bad_weight_budget_is_a_config_error(value):
    with pytest.raises(ConfigError, match="weight_memory_bytes must be None or an int >= 1"):
        EngineConfig(weight_memory_bytes=value)


def test_streaming_is_not_combined_with_expert_parallelism():
    with pytest.raises(ConfigError, match="cannot be combined with expert_parallel_size=2"):
        EngineConfig(weight_memory_bytes=10**9, expert_parallel_size=2)
