"""Ray Data LLM's ``engine_kwargs`` (vLLM's engine arguments) as ``EngineConfig``: no Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen_data import BatchGenProcessorConfig, ConfigError, EngineConfig, build_processor
from batchgen_data.config.engine_args import ENGINE_ARGS, Kind, render_markdown, to_engine_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "engine-kwargs.md"


def test_mapped_arguments_land_in_engine_config_with_vllms_meaning():
    config = to_engine_config({"max_model_len": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
                               "enable_prefix_caching": False, "seed": 7, "block_size": 32, "swap_space": 2,
                               "prefix_caching_hash_algo": "sha256"})
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (4096, 64, 4096)
    assert config.enable_prefix_caching is False and config.seed == 7 and config.block_size == 32
    assert config.swap_space_bytes == 2 * 2**30
    assert [to_engine_config({"dtype": d}).dtype for d in ("auto", "half", "float16", "bfloat16", "bf16", "float",
                                                          "float32")] == [
        "auto", "float16", "float16", "bfloat16", "bfloat16", "float32", "float32"]
    with pytest.raises(ConfigError, match="dtype='int8'"):
        to_engine_config({"dtype": "int8"})


def test_engine_config_fields_keep_working_under_their_own_names():
    assert to_engine_config({"expert_parallel_size": 2, "kv_cache_memory_bytes": 1 << 20}) == EngineConfig(
        expert_parallel_size=2, kv_cache_memory_bytes=1 << 20)


def test_chunked_prefill_off_runs_whole_prompts():
    assert to_engine_config({"enable_chunked_prefill": False}).enable_chunked_prefill is False
    assert to_engine_config({"enable_chunked_prefill": True, "max_model_len": 8192}).max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match="max_num_batched_tokens \\(1024\\) is smaller than max_model_len"):
        to_engine_config({"enable_chunked_prefill": False, "max_model_len": 8192, "max_num_batched_tokens": 1024})


def test_expert_parallel_takes_vllms_group_size():
    assert to_engine_config({"enable_expert_parallel": True, "tensor_parallel_size": 2}).expert_parallel_size == 2
    assert to_engine_config({"enable_expert_parallel": True}).expert_parallel_size == 1
    with pytest.raises(ConfigError, match="give one"):
        to_engine_config({"enable_expert_parallel": True, "tensor_parallel_size": 2, "expert_parallel_size": 4})


def test_no_ops_are_accepted_and_change_nothing():
    kwargs = {"enforce_eager": True, "disable_log_stats": True, "trust_remote_code": True, "tokenizer_mode": "auto",
              "distributed_executor_backend": "ray", "load_format": "safetensors",
              "max_seq_len_to_capture": 8192, "compilation_config": 3, "tensor_parallel_size": 1,
              "pipeline_parallel_size": 1, "kv_cache_dtype": "auto", "max_loras": 1, "max_lora_rank": 8,
              "enable_lora": False, "tokenizer": "demo"}
    assert to_engine_config(kwargs, model_source="demo") == EngineConfig()


def test_distributed_executor_backend_says_how_expert_parallel_ranks_start():
    ranks = {"enable_expert_parallel": True, "tensor_parallel_size": 2}
    assert to_engine_config({**ranks, "distributed_executor_backend": "ray"}).distributed_executor_backend == "ray"
    assert to_engine_config({**ranks, "distributed_executor_backend": "mp"}).distributed_executor_backend == "mp"
    assert to_engine_config({"distributed_executor_backend": "uni"}) == EngineConfig()  # one process: nothing to start
    with pytest.raises(ConfigError, match="runs one process, but this engine has 2 expert-parallel ranks"):
        to_engine_config({"expert_parallel_size": 2, "distributed_executor_backend": "uni"})
    with pytest.raises(ConfigError, match="use 'mp' .* or 'ray'"):
        to_engine_config({"distributed_executor_backend": "slurm"})


def test_gpu_memory_utilization_is_the_share_for_weights_and_kv():
    assert to_engine_config({"gpu_memory_utilization": 0.85}).memory_utilization == 0.85
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        to_engine_config({"gpu_memory_utilization": 1.5})


@pytest.mark.parametrize(("kwargs", "instead"), [
    ({"tensor_parallel_size": 2}, "use expert_parallel_size"),
    ({"pipeline_parallel_size": 2}, "use expert_parallel_size"),
    ({"enable_lora": True, "max_lora_rank": 32}, "merge the adapter"),
    ({"quantization": "fp8"}, "float32/bfloat16/float16 checkpoint"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='auto'"),
    ({"load_format": "runai_streamer"}, "local folder"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode='auto'"),
    ({"tokenizer_mode": "slow"}, "tokenizer_mode='auto'"),
])
def test_refused_arguments_name_themselves_and_the_alternative(kwargs, instead):
    name = next(iter(kwargs))
    with pytest.raises(ConfigError, match=f"engine_kwargs {name}=.*{instead}"):
        to_engine_config(kwargs)


def test_speculative_config_maps_and_refuses_methods_not_built():
    config = to_engine_config({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 5}})
    assert (config.speculative_config.num_speculative_tokens, config.speculative_config.prompt_lookup_max) == (3, 5)
    with pytest.raises(ConfigError, match="method must be one of"):
        to_engine_config({"speculative_config": {"method": "eagle"}})


def test_an_unknown_key_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown engine_kwargs \\['max_num_seq'\\]; known: .*'enforce_eager'"):
        to_engine_config({"max_num_seq": 8})


def test_declaring_any_config_is_fine_and_build_processor_checks_it():
    lora = BatchGenProcessorConfig(model_source="demo", engine_kwargs={"enable_lora": True, "max_lora_rank": 32, "max_loras": 1})
    unknown = BatchGenProcessorConfig(model_source="demo", engine_kwargs={"not_an_argument": 1})
    for config, message in ((lora, "enable_lora=True"), (unknown, "unknown engine_kwargs")):
        with pytest.raises(ConfigError, match=message):
            build_processor(config)


def test_ray_docs_config_builds():
    from batchgen_data.processor import vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source="demo", engine_kwargs={
        "enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "max_model_len": 4096,
        "enforce_eager": True, "trust_remote_code": True, "tokenizer_mode": "auto"})
    assert type(build_processor(config)).__name__ == "Processor"
    engine_config = config.operator_kwargs()["engine_config"]
    assert engine_config == {"max_num_batched_tokens": 4096, "max_model_len": 4096, "enable_chunked_prefill": True}


def test_every_argument_has_a_kind_and_a_reason():
    assert len({a.name for a in ENGINE_ARGS}) == len(ENGINE_ARGS)
    assert all(isinstance(a.kind, Kind) and a.why for a in ENGINE_ARGS)


def test_the_committed_doc_is_the_tables_rendering():
    # regenerate with: python -m batchgen_data.config.engine_args > docs/engine-kwargs.md
    assert DOC.read_text() == render_markdown()
