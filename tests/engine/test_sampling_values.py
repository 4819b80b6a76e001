"""Values the row fuzz found that passed ``SamplingParams.verify`` and then failed a whole batch
(``tests/operators/test_row_fuzz.py``): each is now an error row or well-defined, and the engine
keeps running."""

from __future__ import annotations

import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.errors import ConfigError


@pytest.fixture(scope="module")
def engine(demo_path):
    return Engine(demo_path, EngineConfig(max_num_seqs=4))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_too_small_for_float32_samples_greedily_as_in_vllm(engine, temperature):
    greedy = engine.generate(["Hi there"], SamplingParams(max_tokens=3, temperature=0))[0]
    tiny = engine.generate(["Hi there"], SamplingParams(max_tokens=3, temperature=temperature, seed=1))[0]
    assert tiny.error is None and tiny.token_ids == greedy.token_ids
    after = engine.generate(["Hi there"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert after.token_ids == greedy.token_ids  # the engine kept running


@pytest.mark.parametrize("field", ["skip_special_tokens", "ignore_eos"])
def test_a_non_bool_flag_is_a_config_error_not_a_failed_batch(engine, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: []})
    from batchgen_data.engine.sampling_params import SamplingParams as SP

    params = SP.__new__(SP)  # a row's dict can still reach the engine unverified: the engine checks
    for name, value in SamplingParams(max_tokens=2).to_dict().items():
        object.__setattr__(params, name, value)
    object.__setattr__(params, "_stop_strings", ())
    object.__setattr__(params, field, [])
    good, bad = engine.generate(["Hello", "0"], [SamplingParams(max_tokens=2), params])
    assert good.error is None and bad.finish_reason == "error" and field in bad.error
