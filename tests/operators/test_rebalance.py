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
