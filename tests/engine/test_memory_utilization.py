"""``memory_utilization`` (vLLM's ``gpu_memory_utilization``): the share of device memory that
weights plus the KV pool may take, on the demo model (CPU: the share of physical RAM)."""

from __future__ import annotations

import pytest

from batchgen_data import ConfigError, Engine, EngineConfig, SamplingParams
from batchgen_data.engine.executor.in_process import device_memory_bytes


def _engine(share: float | None, **fields) -> Engine:
    return Engine("demo", EngineConfig(memory_utilization=share, max_num_seqs=8, tune_gemms=False, **fields))


def test_the_kv_pool_is_the_share_left_beside_the_weights():
    plain = _engine(None)
    model = plain.executor.model
    weights = model.resident_weight_bytes
    total = device_memory_bytes(model.device)
    block_bytes = plain.kv_bytes_per_token * EngineConfig().block_size
    uncapped = plain.stats().num_kv_blocks
    assert uncapped > 12
    share = (weights + 10 * block_bytes + block_bytes // 2) / total
    capped = _engine(share)
    assert capped.stats().num_kv_blocks == 10
    out = capped.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.error is None and out.token_ids == plain.generate(
        ["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
    # a share larger than what the running set needs does not grow the pool (it is a cap)
    assert _engine(1.0).stats().num_kv_blocks == uncapped


def test_a_share_the_weights_fill_is_a_config_error():
    plain = _engine(None)
    model = plain.executor.model
    share = model.resident_weight_bytes / device_memory_bytes(model.device) / 2
    with pytest.raises(ConfigError, match="the weights alone take"):
        _engine(share)
    with pytest.raises(ConfigError, match="memory_utilization must be None or in"):
        EngineConfig(memory_utilization=0.0)
