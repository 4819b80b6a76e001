"""Streamed experts read in place: the decode kernels' expert tables over the memory-mapped
checkpoint (``model/moe/in_place.py``), taken only where every tensor is the file's own bytes and
the page cache can hold them; a decode step then copies nothing and gives the resident tokens."""

from __future__ import annotations

import pytest
import torch

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.model.checkpoint import CheckpointReader, moe_prefix
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.expert_sources import layer_experts
from batchgen_data.model.fused_decode import MAX_TOKENS
from batchgen_data.model.moe.in_place import in_place_tables
from batchgen_data.model.native import active_native

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SMALL = dict(max_num_seqs=4, block_size=8, collect_timeline=True)


def _layers(folder, dtype=torch.float32):
    reader = CheckpointReader(folder, dtype, "cpu")
    config = ModelConfig.from_pretrained(folder)
    sparse = [i for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)]
    return reader, {i: layer_experts(reader, moe_prefix(reader, i)[0], config) for i in sparse}


def test_the_tables_point_into_the_checkpoints_mapping_at_each_experts_own_bytes(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    reader, layers = _layers(folder)
    tables = in_place_tables(layers, reader.folder, reader.dtype, "cpu")
    assert tables is not None and set(tables) == set(layers)
    layer_id = min(layers)
    for expert in range(layers[layer_id].num_experts):
        gate, up, down = layers[layer_id].in_place(expert, torch.float32)
        assert tables[layer_id].addresses[expert].tolist() == [gate.data_ptr(), up.data_ptr(), down.data_ptr()]


def test_no_table_where_the_page_cache_cannot_hold_the_experts_or_they_are_not_the_files_bytes(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("mixtral")
    reader, layers = _layers(folder)
    small = tmp_path / "meminfo"
    small.write_text("MemTotal: 1000 kB\nMemAvailable: 4 kB\n")
    assert in_place_tables(layers, reader.folder, reader.dtype, "cpu", meminfo=str(small)) is None
    no_maps = tmp_path / "maps"
    no_maps.write_text("")  # no mapping of the checkpoint: the tensors would not be the file's bytes
    assert in_place_tables(layers, reader.folder, reader.dtype, "cpu", maps=str(no_maps)) is None
    bf16_reader, bf16_layers = _layers(folder, torch.bfloat16)  # stored fp32, computed bf16: converted copies
    assert in_place_tables(bf16_layers, bf16_reader.folder, torch.bfloat16, "cpu") is None


def test_decode_steps_read_streamed_experts_in_place_and_give_the_resident_tokens(tiny_checkpoint, native):
    folder, _ = tiny_checkpoint("mixtral")
    resident = Engine(folder, EngineConfig(**SMALL))
    assert active_native() is not None  # the engine turned the decode kernels on
    refs = [o.token_ids for o in resident.generate(PROMPTS, GREEDY)]
    store = resident.executor.model.expert_store
    config = resident.executor.model.config
    per_expert = store.nbytes // (len(store.layer_ids()) * config.num_experts)
    budget = resident.executor.model.dense_weight_bytes + (config.num_experts_per_tok + 1) * per_expert
    fetched_in_decode = {}
    for in_place in (True, False):
        with Engine(folder, EngineConfig(**SMALL, weight_memory_bytes=budget)) as engine:
            streamed = engine.executor.model.expert_store
            assert streamed.in_place_table(streamed.layer_ids()[0]) is not None
            streamed.read_in_place = in_place
            assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == refs, in_place
            assert engine.stats().offload.read_in_place is in_place
            small = [s for s in engine.timeline if s["num_tokens"] <= MAX_TOKENS]  # the decode kernels' steps
            assert len(small) >= GREEDY.max_tokens - 1
            fetched_in_decode[in_place] = sum(s["expert_misses"] for s in small)
    assert fetched_in_decode[True] == 0 < fetched_in_decode[False]
