"""Stage configs through our import, as Ray's ``stages/test_configs.py`` checks them: they are
Ray's classes, and a stage value resolves (bool, dict, typed copy) as Ray's builder resolves it."""

from __future__ import annotations

import pydantic
import pytest

import batchgen_data
from batchgen_data.config.ray_stages import resolve_stage


@pytest.mark.parametrize("name", ["ChatTemplateStageConfig", "TokenizerStageConfig", "DetokenizeStageConfig",
                                  "PrepareMultimodalStageConfig"])
def test_the_stage_configs_are_rays_classes(name):
    import ray.data.llm

    assert getattr(batchgen_data, name) is getattr(ray.data.llm, name)


def test_a_stage_value_resolves_as_rays_builder_resolves_it():
    from batchgen_data import ChatTemplateStageConfig, PrepareMultimodalStageConfig, TokenizerStageConfig

    resolved = resolve_stage({"enabled": True, "batch_size": 128, "concurrency": 4}, PrepareMultimodalStageConfig)
    assert isinstance(resolved, PrepareMultimodalStageConfig)
    assert (resolved.enabled, resolved.batch_size, resolved.concurrency) == (True, 128, 4)
    original = ChatTemplateStageConfig(enabled=True, batch_size=64, model_source="model1")
    copy = resolve_stage(original, ChatTemplateStageConfig)
    assert copy is not original and copy == original
    assert resolve_stage(True, TokenizerStageConfig).enabled is True
    assert resolve_stage(False, TokenizerStageConfig).enabled is False
    for bad in (None, 123):
        with pytest.raises(TypeError, match="Unsupported type for stage config"):
            resolve_stage(bad, TokenizerStageConfig)
    with pytest.raises(pydantic.ValidationError):
        resolve_stage({"not_a_field": 1}, TokenizerStageConfig)
    assert not hasattr(resolve_stage({}, PrepareMultimodalStageConfig), "model_source")
