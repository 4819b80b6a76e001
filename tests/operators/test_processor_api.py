"""Ray Data LLM's processor API, field for field: stage configs, legacy fields, ``builder_kwargs``,
``task_type``, and Ray's own configs handed to Ray's ``build_processor``. The pipelines themselves
run on a real Ray cluster in ``test_ray_operator.py`` and ``test_ray_llm_doc_shapes.py``."""

from __future__ import annotations

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
        else:
            assert ours.__module__.startswith("batchgen_data"), name


@pytest.mark.parametrize("value", [
    {"chat_template_kwargs": {"enable_thinking": False}, "batch_size": 64},
    ChatTemplateStageConfig(chat_template_kwargs={"enable_thinking": False}, batch_size=64),
])
def test_stage_configs_come_as_bools_dicts_or_classes(value):
    config = vLLMEngineProcessorConfig(model_source="demo", chat_template_stage=value,
                                       tokenize_stage=TokenizerStageConfig(batch_size=8), detokenize_stage=False)
    assert config.chat_template_stage.chat_template_kwargs == {"enable_thinking": False}
    assert config.operator_kwargs()["chat_template_kwargs"] == {"enable_thinking": False}
    assert "detokenize_outputs" not in config.operator_kwargs()
    assert vLLMEngineProcessorConfig().operator_kwargs()["detokenize_outputs"] is True
    with pytest.raises(ConfigError, match="unknown chat_template_stage keys \\['temperature'\\]"):
        vLLMEngineProcessorConfig(chat_template_stage={"temperature": 0})


def test_rays_own_stage_config_objects_are_read():
    from ray.data.llm import ChatTemplateStageConfig as RaysChatTemplate
    from ray.data.llm import DetokenizeStageConfig as RaysDetokenize

    config = vLLMEngineProcessorConfig(chat_template_stage=RaysChatTemplate(chat_template="{{ 'x' }}"),
                                       detokenize_stage=RaysDetokenize(enabled=False))
    assert config.chat_template_stage.chat_template == "{{ 'x' }}" and not config.detokenize_stage.enabled


def test_legacy_fields_set_the_stages_as_older_ray_did():
    config = vLLMEngineProcessorConfig(apply_chat_template=False, tokenize=False, detokenize=False,
                                       chat_template="{{ messages }}")
    assert not config.chat_template_stage.enabled and not config.tokenize_stage.enabled
    assert not config.detokenize_stage.enabled and config.chat_template_stage.chat_template == "{{ messages }}"
    assert config.operator_kwargs()["apply_chat_template"] is False
    with pytest.raises(ConfigError, match="multimodal input is not supported"):
        build_processor(vLLMEngineProcessorConfig(has_image=True))


def test_builder_kwargs_take_rays_chat_template_kwargs():
    processor = build_processor(vLLMEngineProcessorConfig(),
                                builder_kwargs={"chat_template_kwargs": {"enable_thinking": False}})
    assert processor.config.operator_kwargs(processor.chat_template_kwargs)["chat_template_kwargs"] == {
        "enable_thinking": False}
    # the stage's own kwargs win, as in Ray
    staged = vLLMEngineProcessorConfig(chat_template_stage={"chat_template_kwargs": {"a": 1}})
    assert staged.operator_kwargs({"b": 2})["chat_template_kwargs"] == {"a": 1}
    with pytest.raises(ConfigError, match="builder_kwargs cannot contain \\['preprocess'\\]"):
        build_processor(vLLMEngineProcessorConfig(), builder_kwargs={"preprocess": None})
    with pytest.raises(ConfigError, match="unknown builder_kwargs \\['telemetry'\\]"):
        build_processor(vLLMEngineProcessorConfig(), builder_kwargs={"telemetry": 1})
    assert build_llm_processor is build_processor


@pytest.mark.parametrize(("fields", "message"), [
    ({"dynamic_lora_loading_path": "/loras"}, "LoRA adapters are not supported"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}] * 4, "strategy": "STRICT_PACK"}}, "expert_parallel_size"),
    ({"experimental": {"max_tasks_in_flight_per_actor": 4, "other": 1}}, "unknown experimental keys"),
    ({"prepare_image_stage": True}, "multimodal input is not supported"),
    ({"prepare_multimodal_stage": True}, "multimodal input is not supported"),
])
def test_fields_this_engine_cannot_honour_fail_at_build_not_at_declaration(fields, message):
    config = vLLMEngineProcessorConfig(**fields)  # declaring is fine, as in Ray
    with pytest.raises(ConfigError, match=message):
        build_processor(config)


def test_task_type_is_rays_and_wins_over_engine_kwargs():
    config = vLLMEngineProcessorConfig(task_type="embed", engine_kwargs={"task_type": "generate", "max_num_seqs": 4})
    kwargs = config.operator_kwargs()
    assert kwargs["task_type"] == "embed" and kwargs["engine_config"] == {"max_num_seqs": 4}
    with pytest.raises(ConfigError, match="task_type must be one of"):
        vLLMEngineProcessorConfig(task_type="score")
    no_ops = vLLMEngineProcessorConfig(log_engine_metrics=False, max_pending_requests=64,
                                       max_tasks_in_flight_per_actor=16, prepare_image_stage=False,
                                       placement_group_config={"bundles": [{"CPU": 1}], "strategy": "PACK"})
    assert type(build_processor(no_ops)).__name__ == "Processor"
    older = vLLMEngineProcessorConfig(experimental={"max_tasks_in_flight_per_actor": 6})
    assert older.max_tasks_in_flight_per_actor == 6


def test_rays_vllm_config_is_read_field_for_field():
    from ray.data.llm import vLLMEngineProcessorConfig as RaysConfig

    theirs = RaysConfig(model_source="demo", batch_size=7, concurrency=2, engine_kwargs={"max_num_seqs": 8},
                        chat_template_stage={"chat_template_kwargs": {"x": 1}}, should_continue_on_error=True)
    processor = build_processor(theirs)
    ours = processor.config
    assert type(processor).__module__ == "batchgen_data.processor"
    assert (ours.batch_size, ours.concurrency, ours.should_continue_on_error) == (7, 2, True)
    assert ours.operator_kwargs()["engine_config"] == {"max_num_seqs": 8}
    assert ours.chat_template_stage.chat_template_kwargs == {"x": 1}


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
    assert rows[1].error == "invalid sampling_params: n must be an int >= 1, got 0"
    assert rows[2].error is None


def test_older_ray_names_are_read():
    config = vLLMEngineProcessorConfig(model="demo", resources_per_bundle={"CPU": 1},
                                       engine_kwargs={"model": "ignored", "enforce_eager": True})
    assert config.model_source == "demo" and config.operator_kwargs()["engine_config"] == {}
    with pytest.raises(ConfigError, match="mm_processor_kwargs.*multimodal"):
        build_processor(vLLMEngineProcessorConfig(engine_kwargs={"mm_processor_kwargs": {"x": 1}}))


def test_placement_group_config_sizes_the_expert_parallel_ranks():
    """Ray Data LLM's placement_group_config: with expert_parallel_size N its N equal bundles (or
    one, or bundle_per_worker) are each rank's bundle and its strategy the ranks' group's."""
    def placement(ranks, group):
        return vLLMEngineProcessorConfig(engine_kwargs={"expert_parallel_size": ranks},
                                         placement_group_config=group).rank_placement()

    assert placement(2, {"bundles": [{"CPU": 2, "GPU": 1}] * 2, "strategy": "STRICT_SPREAD"}) == {
        "rank_resources": {"CPU": 2, "GPU": 1}, "placement_strategy": "STRICT_SPREAD"}
    assert placement(4, {"bundle_per_worker": {"CPU": 1}}) == {"rank_resources": {"CPU": 1}}
    assert placement(1, {"bundles": [{"CPU": 1}]}) == {}  # one rank: the bundle is the actor's
    with pytest.raises(ConfigError, match="takes 2 equal bundles"):
        placement(2, {"bundles": [{"CPU": 1}, {"CPU": 2}]})
    with pytest.raises(ConfigError, match="placement_strategy must be one of"):
        placement(2, {"bundles": [{"CPU": 1}] * 2, "strategy": "PACKED"})
    config = vLLMEngineProcessorConfig(engine_kwargs={"enable_expert_parallel": True, "tensor_parallel_size": 2},
                                       placement_group_config={"bundles": [{"CPU": 1}] * 2, "strategy": "SPREAD"})
    assert config.operator_kwargs()["engine_config"] == {"expert_parallel_size": 2, "rank_resources": {"CPU": 1},
                                                         "placement_strategy": "SPREAD"}
