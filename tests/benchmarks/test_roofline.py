"""Roofline accounting: the engine's per-step work counts and the per-step floor built on them."""

from __future__ import annotations

import pytest
from tiny_checkpoints import _COMMON, ARCHITECTURES

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.model import ModelConfig
from benchmarks.roofline import step_floor_seconds


def _config(arch: str) -> ModelConfig:
    return ModelConfig.from_dict({**_COMMON, **ARCHITECTURES[arch]})


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_floor_reads_every_weight_once_when_every_expert_runs(arch):
    """A step that runs every expert of every layer and samples reads all weights but the
    embedding table: the parameter count the config reports independently."""
    config = _config(arch)
    sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    step = {"num_tokens": 1, "num_sampled": 1, "expert_calls": config.num_experts * sparse,
            "context_tokens": 0, "attended_keys": 0}
    embedding = config.vocab_size * config.hidden_size
    lm_head_is_embedding = config.tie_word_embeddings
    weights = config.num_params - (0 if lm_head_is_embedding else embedding)
    # At 1 GB/s and an unbounded matmul rate the floor is the bytes read, in nanoseconds.
    assert step_floor_seconds(step, config, gflops=1e12, bandwidth_gbs=1.0) * 1e9 == pytest.approx(4 * weights)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_floor_counts_two_flops_per_active_parameter_and_the_attention_scores(arch):
    config = _config(arch)
    tokens, keys = 300, 5000
    step = {"num_tokens": tokens, "num_sampled": tokens, "expert_calls": 0, "context_tokens": 0, "attended_keys": keys}
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * keys
    expected = 2 * tokens * config.active_params_per_token + attention
    # At 1 GFLOP/s and unbounded bandwidth the floor is the FLOPs, in nanoseconds.
    assert step_floor_seconds(step, config, gflops=1.0, bandwidth_gbs=1e12) * 1e9 == pytest.approx(expected)


def test_floor_adds_the_kv_each_layer_reads():
    config = _config("mixtral")
    base = {"num_tokens": 1, "num_sampled": 0, "expert_calls": 0, "context_tokens": 0, "attended_keys": 0}
    more = {**base, "context_tokens": 1000}
    extra = step_floor_seconds(more, config, 1e12, 1.0) - step_floor_seconds(base, config, 1e12, 1.0)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert extra * 1e9 == pytest.approx(1000 * per_token)


def test_engine_timeline_records_the_work_and_module_seconds_of_each_step(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    engine = Engine(folder, EngineConfig(block_size=8, collect_timeline=True))
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    steps = engine.timeline
    assert [s["context_tokens"] for s in steps] == [5, 6, 7]
    assert [s["attended_keys"] for s in steps] == [15, 6, 7]  # causal prefill: 1 + 2 + ... + 5
    config = ModelConfig.from_pretrained(folder)
    top_k, layers = config.num_experts_per_tok, config.num_hidden_layers
    assert top_k * layers <= steps[0]["expert_calls"] <= config.num_experts * layers
    for step in steps[1:]:  # one decoded token routes to exactly top_k distinct experts per layer
        assert step["expert_calls"] == top_k * layers
    for step in steps:
        modules = step["attention_s"] + step["moe_s"] + step["logits_s"]
        assert 0 < modules <= step["step_s"]
        assert min(step["attention_s"], step["moe_s"], step["logits_s"]) > 0
