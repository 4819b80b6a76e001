"""Streamed experts (``weight_memory_bytes``): what the pool holds, the load-time checks."""

from __future__ import annotations

import random
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen_data.errors import CheckpointError, ConfigError
from batchgen_data.model import MoEModel
from batchgen_data.model.moe.streamed_store import StreamedExpertStore


def minimum_budget(folder) -> int:
    """The smallest weight budget the checkpoint loads with, as the load error states it."""
    with pytest.raises(ConfigError) as err:
        MoEModel.from_pretrained(folder, weight_memory_bytes=1)
    return int(re.search(r"the minimum is (\d+) bytes", str(err.value)).group(1))


def test_too_small_a_budget_names_the_minimum_and_the_minimum_loads(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    resident = MoEModel.from_pretrained(folder)
    expert_bytes = resident.expert_store.nbytes // (3 * 4)  # 3 sparse layers x 4 experts
    minimum = minimum_budget(folder)
    assert minimum == resident.dense_weight_bytes + 2 * expert_bytes  # dense + one layer's top-2
    with pytest.raises(ConfigError, match=f"weight_memory_bytes={minimum - 1} .* minimum is {minimum} bytes"):
        MoEModel.from_pretrained(folder, weight_memory_bytes=minimum - 1)
    store = MoEModel.from_pretrained(folder, weight_memory_bytes=minimum).expert_store
    assert isinstance(store, StreamedExpertStore) and store.capacity == 2
    store.close()
    # A budget holding every weight keeps the experts resident.
    assert not isinstance(MoEModel.from_pretrained(folder, weight_memory_bytes=10**9).expert_store, StreamedExpertStore)


@pytest.mark.parametrize("eviction", ["next_use", "lru"])
def test_every_answer_holds_the_requested_experts_and_never_more_than_the_pool(tiny_checkpoint, eviction):
    # Random requests over the layer cycle while the fetch thread prefetches and evicts: each
    # answer's rows hold exactly the resident weights of the experts asked for.
    folder, _ = tiny_checkpoint("qwen2_moe")  # 6 experts, 3 sparse layers
    resident = MoEModel.from_pretrained(folder).expert_store
    model = MoEModel.from_pretrained(folder, weight_memory_bytes=minimum_budget(folder) + 3 * resident.nbytes // 18)
    store = model.expert_store
    store.eviction = eviction
    store.warm()
    rng = random.Random(0)
    try:
        for _ in range(60):
            for layer in store.layer_ids():
                ids = sorted(rng.sample(range(6), rng.randint(1, store.capacity)))
                answer = store.weights(layer, ids)
                assert answer.w_gate_up.shape[0] == store.capacity  # the pool, never more
                assert sorted(int(e) for e in torch.nonzero(answer.row_of >= 0)) == ids
                for e in ids:
                    row = answer.row(e)
                    assert torch.equal(answer.w_gate_up[row], resident.weights(layer).w_gate_up[e])
                    assert torch.equal(answer.w_down[row], resident.weights(layer).w_down[e])
        with pytest.raises(ValueError, match=f"at most {store.capacity} experts"):
            store.weights(store.layer_ids()[0], list(range(store.capacity + 1)))
        stats = store.stats
        assert stats.num_prefetched > 0 and stats.num_hits > 0  # the fetch thread ran ahead of the requests
        assert stats.bytes_fetched == (stats.num_misses + stats.num_prefetched) * store.bytes_per_expert
    finally:
        store.close()


def test_a_closed_store_refuses_requests_instead_of_waiting_forever(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    store = MoEModel.from_pretrained(folder, weight_memory_bytes=minimum_budget(folder)).expert_store
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.weights(store.layer_ids()[0], [0, 1])


def test_gpt_oss_biases_stream_with_their_experts(tiny_checkpoint):
    folder, _ = tiny_checkpoint("gpt_oss")
    resident = MoEModel.from_pretrained(folder).expert_store
    store = MoEModel.from_pretrained(folder, weight_memory_bytes=minimum_budget(folder)).expert_store
    try:
        layer = store.layer_ids()[-1]
        answer = store.weights(layer, [1, 3])
        for e in (1, 3):
            assert torch.equal(answer.b_gate_up[answer.row(e)], resident.weights(layer).b_gate_up[e])
            assert torch.equal(answer.b_down[answer.row(e)], resident.weights(layer).b_down[e])
    finally:
        store.close()


def _sharded_copy(tiny_checkpoint, tmp_path):
    folder, hf = tiny_checkpoint("mixtral")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    budget = minimum_budget(folder)
    shard = next(p for p in sorted(sharded.glob("*.safetensors")) if any(".experts." in k for k in load_file(p)))
    return sharded, shard, budget


def test_a_missing_shard_fails_at_load(tiny_checkpoint, tmp_path):
    sharded, shard, budget = _sharded_copy(tiny_checkpoint, tmp_path)
    shard.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        MoEModel.from_pretrained(sharded, weight_memory_bytes=budget)


def test_a_truncated_shard_fails_at_load(tiny_checkpoint, tmp_path):
    sharded, shard, budget = _sharded_copy(tiny_checkpoint, tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match="cannot be read"):
        MoEModel.from_pretrained(sharded, weight_memory_bytes=budget)


def test_an_expert_missing_from_its_shard_fails_at_load_not_mid_job(tiny_checkpoint, tmp_path):
    sharded, shard, budget = _sharded_copy(tiny_checkpoint, tmp_path)
    tensors = load_file(shard)
    gone = sorted(k for k in tensors if ".experts." in k)[-1]
    del tensors[gone]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        MoEModel.from_pretrained(sharded, weight_memory_bytes=budget)
