"""Ray Data LLM's processor API, field for field: stage configs, legacy fields, ``builder_kwargs``,
``task_type``, and Ray's own configs handed to Ray's ``build_processor``. The pipelines themselves
run on a real Ray cluster in ``test_ray_operator.py`` and ``test_ray_llm_doc_shapes.py``."""

from __future__ import annotations

import pydantic
import pytest

import batchgen_data
from batchgen_data import (
    ChatTemplateStageConfig,
    ConfigError,
    DetokenizeStageConfig,
    TokenizerStageConfig,
    build_llm_processor,
    build_processor,
    vLLMEngineProcessorConfig,
)

pytestmark = pytest.mark.timeout(120)


def test_one_import_line_gives_every_name_ray_data_llm_exports():
    import ray.data.llm

    for name in ray.data.llm.__all__:
        ours = getattr(batchgen_data, name)
        theirs = getattr(ray.data.llm, name)
        if name in ("HttpRequestProcessorConfig", "ServeDeploymentProcessorConfig", "SGLangEngineProcessorConfig",
                    "HttpRequestStageConfig", "ProcessorConfig"):
            assert ours is theirs, name  # Ray's processors stay Ray's
        elif name.endswith("StageConfig"):
            assert ours is theirs, name  # the stage configs are Ray's own classes
        else:
            assert ours.__module__.startswith("batchgen_data"), name


@pytest.mark.parametrize("value", [
    {"chat_template_kwargs": {"enable_thinking": False}, "batch_size": 64},
    ChatTemplateStageConfig(chat_template_kwargs={"enable_thinking": False}, batch_size=64),
])
def test_stage_configs_come_as_bools_dicts_or_classes(value):
    config = vLLMEngineProcessorConfig(model_source="demo", chat_template_stage=value,
                                       tokenize_stage=TokenizerStageConfig(batch_size=8), detokenize_stage=False)
    assert config.chat_template_stage is value  # stored as given, as in Ray
    assert config.stage("chat_template_stage").chat_template_kwargs == {"enable_thinking": False}
    assert config.operator_kwargs()["chat_template_kwargs"] == {"enable_thinking": False}
    assert "detokenize_outputs" not in config.operator_kwargs()
    assert vLLMEngineProcessorConfig(model_source="demo").operator_kwargs()["detokenize_outputs"] is True
    bad = vLLMEngineProcessorConfig(model_source="demo", chat_template_stage={"temperature": 0})
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        build_processor(bad)
    with pytest.raises(TypeError, match="Unsupported type for stage config"):
        build_processor(vLLMEngineProcessorConfig(model_source="demo", tokenize_stage=123))


def test_rays_internal_stage_config_objects_are_read():
    from ray.llm._internal.batch.stages.configs import ChatTemplateStageConfig as RaysInternal

    config = vLLMEngineProcessorConfig(model_source="demo", chat_template_stage=RaysInternal(chat_template="{{ 'x' }}"),
                                       detokenize_stage=DetokenizeStageConfig(enabled=False))
    assert config.stage("chat_template_stage").chat_template == "{{ 'x' }}"
    assert not config.stage("detokenize_stage").enabled


def test_legacy_flags_set_the_stages_as_ray_2_58_did():
    config = vLLMEngineProcessorConfig(model_source="demo", apply_chat_template=False, tokenize=False,
                                       detokenize=False, chat_template="{{ messages }}")
    assert config.chat_template_stage == {"enabled": False, "chat_template": "{{ messages }}"}
    assert config.tokenize_stage == {"enabled": False} and config.detokenize_stage == {"enabled": False}
    assert config.operator_kwargs()["apply_chat_template"] is False
    explicit = ChatTemplateStageConfig(enabled=True, batch_size=64)
    assert vLLMEngineProcessorConfig(model_source="demo", chat_template_stage=explicit,
                                     apply_chat_template=False).chat_template_stage is explicit  # explicit wins


@pytest.mark.parametrize("field", ["has_image", "prepare_image_stage", "model", "experimental",
                                   "resources_per_bundle"])
def test_fields_ray_removed_are_refused_as_ray_refuses_them(field):
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        vLLMEngineProcessorConfig(model_source="demo", **{field: True})


def test_builder_kwargs_take_rays_chat_template_kwargs():
    processor = build_processor(vLLMEngineProcessorConfig(model_source="demo"),
                                builder_kwargs={"chat_template_kwargs": {"enable_thinking": False}})
    engine = processor.get_stage_by_name("vLLMEngineStage")
    assert engine.fn_constructor_kwargs["chat_template_kwargs"] == {"enable_thinking": False}
    # the stage's own kwargs win, as in Ray
    staged = vLLMEngineProcessorConfig(model_source="demo", chat_template_stage={"chat_template_kwargs": {"a": 1}})
    assert staged.operator_kwargs({"b": 2})["chat_template_kwargs"] == {"a": 1}
    with pytest.raises(ValueError, match="builder_kwargs cannot contain \\['preprocess'\\]"):
        build_processor(vLLMEngineProcessorConfig(model_source="demo"), builder_kwargs={"preprocess": None})
    with pytest.raises(TypeError, match="telemetry"):
        build_processor(vLLMEngineProcessorConfig(model_source="demo"), builder_kwargs={"telemetry": 1})
    assert build_llm_processor is build_processor


@pytest.mark.parametrize(("fields", "message"), [
    ({"dynamic_lora_loading_path": "/loras"}, "LoRA adapters are not supported"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}] * 4, "strategy": "STRICT_PACK"}}, "expert_parallel_size"),
    ({"prepare_multimodal_stage": True}, "multimodal input is not supported"),
    ({"task_type": "score"}, "task_type='score' is not supported here"),
])
def test_fields_this_engine_cannot_honour_fail_at_build_not_at_declaration(fields, message):
    config = vLLMEngineProcessorConfig(model_source="demo", **fields)  # declaring is fine, as in Ray
    with pytest.raises(ConfigError, match=message):
        build_processor(config)


def test_task_type_is_rays_and_wins_over_engine_kwargs():
    config = vLLMEngineProcessorConfig(model_source="demo", task_type="embed",
                                       engine_kwargs={"task_type": "generate", "max_num_seqs": 4})
    kwargs = config.operator_kwargs()
    assert kwargs["task_type"] == "embed" and kwargs["engine_config"] == {"max_num_seqs": 4}
    with pytest.raises(pydantic.ValidationError, match="Invalid task type: sing"):
        vLLMEngineProcessorConfig(model_source="demo", task_type="sing")
    no_ops = vLLMEngineProcessorConfig(model_source="demo", log_engine_metrics=False, max_pending_requests=64,
                                       max_tasks_in_flight_per_actor=16,
                                       placement_group_config={"bundles": [{"CPU": 1}], "strategy": "PACK"})
    assert type(build_processor(no_ops)).__name__ == "Processor"


def test_rays_vllm_config_is_read_field_for_field():
    from ray.data.llm import vLLMEngineProcessorConfig as RaysConfig

    theirs = RaysConfig(model_source="demo", batch_size=7, concurrency=2, engine_kwargs={"max_num_seqs": 8},
                        chat_template_stage={"chat_template_kwargs": {"x": 1}}, should_continue_on_error=True)
    processor = build_processor(theirs)
    ours = processor.config
    assert type(processor).__module__ == "batchgen_data.processor" and isinstance(ours, RaysConfig)
    assert (ours.batch_size, ours.concurrency, ours.should_continue_on_error) == (7, 2, True)
    assert ours.operator_kwargs()["engine_config"] == {"max_num_seqs": 8}
    assert ours.stage("chat_template_stage").chat_template_kwargs == {"x": 1}


def test_configs_this_engine_does_not_run_go_to_rays_build_processor(ray_cluster):
    from batchgen_data import HttpRequestProcessorConfig

    config = HttpRequestProcessorConfig(url="http://127.0.0.1:9/v1/chat/completions", qps=1)
    processor = build_processor(config, preprocess=lambda row: {"payload": {"x": row["id"]}},
                                postprocess=lambda row: row)
    assert type(processor).__module__.startswith("ray.llm")
    assert [name for name in processor.stages] == ["HttpRequestStage"]


def test_n_takes_rays_first_output_and_is_checked():
    from batchgen_data.operators.rows import StageConfig, prepare_rows

    rows = prepare_rows({"prompt": ["a", "b", "c"], "sampling_params": [{"n": 3, "max_tokens": 2}, {"n": 0},
                                                                         {"n": 2.0}]}, 3, StageConfig())
    assert rows[0].error is None and rows[0].params.max_tokens == 2
    assert rows[1].error == "RowError: invalid sampling_params: n must be an int >= 1, got 0"
    assert rows[2].error is None


def test_engine_kwargs_this_engine_cannot_honour_name_what_to_use():
    config = vLLMEngineProcessorConfig(model_source="demo", engine_kwargs={"model": "ignored", "enforce_eager": True})
    assert config.operator_kwargs()["engine_config"] == {}
    with pytest.raises(ConfigError, match="mm_processor_kwargs.*multimodal"):
        build_processor(vLLMEngineProcessorConfig(model_source="demo", engine_kwargs={"mm_processor_kwargs": {"x": 1}}))


def test_placement_group_config_sizes_the_expert_parallel_ranks():
    """Ray Data LLM's placement_group_config: with expert_parallel_size N its N equal bundles (or
    one, or bundle_per_worker) are each rank's bundle and its strategy the ranks' group's."""
    def placement(ranks, group):
        return vLLMEngineProcessorConfig(model_source="demo", engine_kwargs={"expert_parallel_size": ranks},
                                         placement_group_config=group).rank_placement()

    # (as Ray's PlacementGroupConfig normalizes them: float amounts, GPU 0 where none, strategy PACK)
    assert placement(2, {"bundles": [{"CPU": 2, "GPU": 1}] * 2, "strategy": "STRICT_SPREAD"}) == {
        "rank_resources": {"CPU": 2, "GPU": 1}, "placement_strategy": "STRICT_SPREAD"}
    assert placement(4, {"bundle_per_worker": {"CPU": 1}}) == {"rank_resources": {"CPU": 1, "GPU": 0},
                                                               "placement_strategy": "PACK"}
    assert placement(1, {"bundles": [{"CPU": 1}]}) == {}  # one rank: the bundle is the actor's
    with pytest.raises(ConfigError, match="takes 2 equal bundles"):
        placement(2, {"bundles": [{"CPU": 1}, {"CPU": 2}]})
    with pytest.raises(pydantic.ValidationError, match="strategy"):  # Ray's PlacementGroupConfig
        placement(2, {"bundles": [{"CPU": 1}] * 2, "strategy": "PACKED"})
    config = vLLMEngineProcessorConfig(model_source="demo", engine_kwargs={"enable_expert_parallel": True, "tensor_parallel_size": 2},
                                       placement_group_config={"bundles": [{"CPU": 1}] * 2, "strategy": "SPREAD"})
    assert config.operator_kwargs()["engine_config"] == {"expert_parallel_size": 2,
                                                         "rank_resources": {"CPU": 1, "GPU": 0},
                                                         "placement_strategy": "SPREAD"}
