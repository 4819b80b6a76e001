"""Older Ray Data LLM configs through our import, as Ray's ``test_backward_compat.py`` checks
them: the flat flags of Ray 2.53-2.58 become stage dicts (an explicit stage config wins, and is
kept as the same object), the new API warns nothing, and the fields Ray removed are refused."""

from __future__ import annotations

import warnings

import pydantic
import pytest

from batchgen_data import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    PrepareMultimodalStageConfig,
    TokenizerStageConfig,
    vLLMEngineProcessorConfig,
)


def test_legacy_flags_become_stage_dicts():
    config = vLLMEngineProcessorConfig(model_source="test-model", apply_chat_template=True, tokenize=False,
                                       detokenize=True)
    assert isinstance(config.chat_template_stage, dict) and config.chat_template_stage["enabled"] is True
    assert isinstance(config.tokenize_stage, dict) and config.tokenize_stage["enabled"] is False
    assert isinstance(config.detokenize_stage, dict) and config.detokenize_stage["enabled"] is True
    templated = vLLMEngineProcessorConfig(model_source="test-model", apply_chat_template=True,
                                          chat_template="custom_template")
    assert templated.chat_template_stage == {"enabled": True, "chat_template": "custom_template"}


def test_an_explicit_stage_config_wins_and_is_kept_as_given():
    explicit = ChatTemplateStageConfig(enabled=False, batch_size=64)
    config = vLLMEngineProcessorConfig(model_source="test-model", chat_template_stage=explicit,
                                       apply_chat_template=True)
    assert config.chat_template_stage is explicit
    assert config.chat_template_stage.enabled is False and config.chat_template_stage.batch_size == 64


def test_the_new_api_warns_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vLLMEngineProcessorConfig(model_source="test-model",
                                  chat_template_stage=ChatTemplateStageConfig(enabled=True),
                                  tokenize_stage=TokenizerStageConfig(enabled=True),
                                  detokenize_stage=DetokenizeStageConfig(enabled=True),
                                  prepare_multimodal_stage=PrepareMultimodalStageConfig(enabled=False))
    assert [w for w in caught if issubclass(w.category, UserWarning)] == []


def test_stage_dicts_are_stored_as_dicts():
    config = vLLMEngineProcessorConfig(model_source="test-model",
                                       chat_template_stage={"enabled": False, "batch_size": 128},
                                       tokenize_stage={"enabled": True, "concurrency": 4})
    assert config.chat_template_stage == {"enabled": False, "batch_size": 128}
    assert config.tokenize_stage == {"enabled": True, "concurrency": 4}


@pytest.mark.parametrize("legacy_field", ["has_image", "prepare_image_stage"])
def test_removed_image_fields_are_refused(legacy_field):
    with pytest.raises(pydantic.ValidationError):
        vLLMEngineProcessorConfig(model_source="test-model", **{legacy_field: True})
