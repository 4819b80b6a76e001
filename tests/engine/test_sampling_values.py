"""Values the row fuzz found that passed ``SamplingParams.verify`` and then failed a whole batch
(``tests/operators/test_row_fuzz.py``): each is now an error row or well-defined, and the engine
keeps running."""

from __future__ import annotations

import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.errors import ConfigError
from batchgen_data.operators.rows import StageConfig, prepare_rows


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
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ConfigError, match=field):  # set later: checked as it is set, left as it was
        setattr(params, field, [])
    assert isinstance(getattr(params, field), bool)
    [row] = prepare_rows({"prompt": ["0"], "sampling_params": [{field: []}]}, 1, StageConfig())
    assert row.params is None and field in row.error  # a row's dict: an error row
    good = engine.generate(["Hello"], params)[0]
    assert good.error is None


def test_detokenize_false_gives_token_ids_and_an_empty_text_and_refuses_stop_strings(engine):
    text = engine.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))[0]
    ids = engine.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0, detokenize=False))[0]
    assert ids.token_ids == text.token_ids and text.text and ids.text == ""
    with pytest.raises(ConfigError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(engine):
    full = engine.generate(["Tell me"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), full
    cut = engine.generate(["Tell me"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=stop))[0]
    kept = engine.generate(["Tell me"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=True))[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)] and kept.text == cut.text + stop


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_the_prompt(engine):
    prompt = list(range(100, 140))
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, truncate_prompt_tokens=8))[0]
    ref = engine.generate([prompt[-8:]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == prompt[-8:] and out.num_input_tokens == 8 and out.token_ids == ref.token_ids
    whole = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == prompt  # fits the context limit: nothing cut
    for bad in (0, -2, 1.5):
        with pytest.raises(ConfigError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
