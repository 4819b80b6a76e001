"""The processor through our import, as Ray's ``test_processor_base.py``,
``test_processor_no_blocking.py`` and ``test_http_request_proc.py`` check it: Ray's constructor,
stage names and lookups, ``builder_kwargs`` errors, the engine stage's actor pool, and Ray's own
processors built by Ray."""

from __future__ import annotations

import pytest
import ray

from batchgen_data import HttpRequestProcessorConfig, Processor, ProcessorConfig, build_processor
from batchgen_data import vLLMEngineProcessorConfig
from batchgen_data.processor.stages import ProcessorStage

pytestmark = pytest.mark.timeout(180)


def test_a_processor_without_stages_runs_preprocess_then_postprocess(ray_cluster):
    processor = Processor(config=ProcessorConfig(batch_size=64, accelerator_type=None, concurrency=1), stages=[],
                          preprocess=lambda row: {"val": row["id"] + 5},
                          postprocess=lambda row: {"result": row["val"], "id": row["id"]})
    rows = sorted(processor(ray.data.range(5)).take_all(), key=lambda r: r["id"])
    assert rows == [{"result": i + 5, "id": i} for i in range(5)]  # only postprocess's output is kept
    bare = Processor(config=ProcessorConfig(batch_size=64), stages=[])
    assert sorted(r["id"] for r in bare(ray.data.range(5)).take_all()) == list(range(5))


def test_stages_are_named_by_class_and_found_by_name():
    class DummyStage(ProcessorStage):
        pass

    stages = [DummyStage(fn_constructor_kwargs={"factor": 2}), DummyStage(fn_constructor_kwargs={"factor": 3})]
    processor = Processor(config=ProcessorConfig(batch_size=64), stages=stages)
    assert processor.list_stage_names() == ["DummyStage", "DummyStage_1"]
    for name, stage in zip(processor.list_stage_names(), stages):
        assert processor.get_stage_by_name(name) is stage
    with pytest.raises(ValueError, match="Stage Nope not found"):
        processor.get_stage_by_name("Nope")


def test_build_processor_names_rays_stages_in_rays_order():
    processor = build_processor(vLLMEngineProcessorConfig(model_source="demo"))
    assert processor.list_stage_names() == ["ChatTemplateStage", "TokenizeStage", "vLLMEngineStage",
                                            "DetokenizeStage"]
    bare = build_processor(vLLMEngineProcessorConfig(model_source="demo", chat_template_stage=False,
                                                     tokenize_stage=False, detokenize_stage=False))
    assert bare.list_stage_names() == ["vLLMEngineStage"]


def test_builder_kwargs_errors_are_rays():
    config = vLLMEngineProcessorConfig(model_source="demo")
    for key in ("preprocess", "postprocess"):
        with pytest.raises(ValueError, match="builder_kwargs cannot contain"):
            build_processor(config, builder_kwargs={key: lambda row: row})
    with pytest.raises(TypeError, match="unsupported_kwarg"):
        build_processor(config, builder_kwargs={"unsupported_kwarg": "value"})


@pytest.mark.parametrize(("concurrency", "sizes"), [(4, (4, 4)), ((1, 4), (1, 4)), ((2, 8), (2, 8))])
def test_the_engine_stage_pool_and_the_data_context_left_alone(concurrency, sizes):
    """Ray 2.54's sizes (an int is a fixed pool here; Ray 2.55+ autoscales 1..n: README "what
    differs"), and building leaves ``wait_for_min_actors_s`` as the user set it."""
    context = ray.data.DataContext.get_current()
    before = context.wait_for_min_actors_s
    try:
        context.wait_for_min_actors_s = 60
        processor = build_processor(vLLMEngineProcessorConfig(model_source="demo", concurrency=concurrency))
        assert context.wait_for_min_actors_s == 60
    finally:
        context.wait_for_min_actors_s = before
    compute = processor.get_stage_by_name("vLLMEngineStage").map_batches_kwargs["compute"]
    assert (compute.min_size, compute.max_size) == sizes


def test_rays_own_processors_are_built_by_ray(ray_cluster):
    config = HttpRequestProcessorConfig(url="http://localhost:8000", headers={"Authorization": "Bearer 1234567890"},
                                        qps=2, concurrency=4, batch_size=64)
    processor = build_processor(config)
    assert processor.list_stage_names() == ["HttpRequestStage"]
    kwargs = processor.get_stage_by_name("HttpRequestStage").fn_constructor_kwargs
    assert kwargs["url"] == "http://localhost:8000" and kwargs["qps"] == 2
    assert kwargs["additional_header"] == {"Authorization": "Bearer 1234567890"}
