"""Ray Data LLM's documentation pipelines, in their shapes, on batchgen-data.

Each test is one of Ray's ``doc/source/data/doc_code/working-with-llms/`` examples (or a shape
Ray's ``python/ray/llm/tests/batch/`` runs), written anew with our own rows: the same config
fields, stage configs, legacy flags, ``engine_kwargs``, row columns, ``sampling_params`` keys and
postprocess reads, with only the import (``batchgen_data`` for ``ray.data.llm``), the model
(``"demo"``), the sizes (a few rows, ``max_tokens`` 8) and GPU-only settings changed. Every
pipeline runs on the module's real local Ray cluster and checks rows in == rows out, no error
rows, and that postprocess saw what it reads.

Classification runs on a tiny random classifier checkpoint (the docs' model is a classifier; the
demo model has no classification head).
"""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(120)

MODEL = "demo"
MAX_TOKENS = 8
ERROR = "__inference_error__"


@pytest.fixture(scope="module", autouse=True)
def _ship_module_by_value():
    """This module's functions run in Ray workers (the custom stages): ship them by value, since
    pytest imports test modules under names workers cannot import."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _no_errors(rows: list[dict]) -> None:
    for row in rows:
        assert row.get(ERROR) in (None, ""), row


def _text(value) -> str:
    assert isinstance(value, str), value
    return value


def _run(processor, items: list) -> list[dict]:
    out = processor(ray.data.from_items(items)).take_all()
    assert len(out) == len(items)
    _no_errors(out)
    return out


QUESTIONS = ["Name a colour of the sky.", "Say hello in French.", "Count to three.", "What is two plus two?"]


# --- minimal_quickstart.py: prompt rows, preprocess builds messages (both columns in the row) ---

def test_minimal_quickstart_prompt_rows_become_messages(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, concurrency=1, batch_size=4,
                                       engine_kwargs={"max_model_len": 4096})
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "messages": [{"role": "user", "content": row["prompt"]}],
            "sampling_params": {"temperature": 0.7, "max_tokens": MAX_TOKENS},
        },
        postprocess=lambda row: {"prompt": row["prompt"], "response": row["generated_text"]},
    )
    items = [{"prompt": q} for q in QUESTIONS[:3]]
    out = _run(processor, items)
    # postprocess reads "prompt": the row's own, or (as Ray's chat template stage writes it) the rendered
    # chat text that holds it
    for item in items:
        assert sum(item["prompt"] in _text(r["prompt"]) for r in out) == 1
    assert all(_text(r["response"]) for r in out)
    assert all(set(r) == {"prompt", "response"} for r in out)  # only what postprocess returns


# --- basic_llm_example.py: item rows (from_items of strings), system + user messages,
#     chunked-prefill engine_kwargs, postprocess keeps every column with **row ---

def test_basic_llm_example_haiku_shape(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=MODEL,
        engine_kwargs={"enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "max_model_len": 4096},
        concurrency=1,
        batch_size=4,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "system", "content": "You answer in three short lines."},
                      {"role": "user", "content": row["item"]}],
            sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS),
        ),
        postprocess=lambda row: dict(answer=row["generated_text"], **row),
    )
    items = ["Begin a short poem about rain...", "Begin a short poem about snow..."]
    out = _run(processor, items)
    assert sorted(r["item"] for r in out) == sorted(items)
    for row in out:
        assert _text(row["answer"]) and row["answer"] == row["generated_text"]
        assert "messages" in row and "sampling_params" in row  # **row: every column reaches the output


def test_build_llm_processor_name_of_older_docs():
    """Older basic_llm_example / embedding_example / vlm_example / openai_api_example import
    ``build_llm_processor`` (Ray's name before ``build_processor``); the embedding test runs it."""
    from batchgen_data import build_llm_processor, build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, engine_kwargs={"max_model_len": 16384},
                                       concurrency=1, batch_size=32)
    kwargs = dict(preprocess=lambda row: dict(messages=[{"role": "user", "content": row["item"]}],
                                              sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS)),
                  postprocess=lambda row: dict(answer=row["generated_text"], **row))
    assert type(build_llm_processor(config, **kwargs)) is type(build_processor(config, **kwargs))


# --- the configs basic_llm_example.py (and working-with-llms.rst) declare beside the one it runs ---

DECLARED_MUST_BUILD = {
    # __hf_token_config_example__
    "hf_token": dict(model_source=MODEL, runtime_env={"env_vars": {"HF_TOKEN": "not-a-token"}},
                     concurrency=1, batch_size=64),
    # __gpu_memory_config_example__ (both configs)
    "memory_optimized": dict(model_source=MODEL, engine_kwargs={
        "max_model_len": 8192, "max_num_batched_tokens": 2048, "enable_chunked_prefill": True,
        "gpu_memory_utilization": 0.85, "block_size": 16}, concurrency=1, batch_size=16),
    "minimal_memory": dict(model_source=MODEL, engine_kwargs={
        "max_model_len": 4096, "max_num_batched_tokens": 1024, "enable_chunked_prefill": True,
        "gpu_memory_utilization": 0.75}, concurrency=1, batch_size=8),
    # __concurrent_config_example__ and __concurrent_config_fixed_pool_example__ (rst: (n, n))
    "concurrent": dict(model_source=MODEL, engine_kwargs={
        "enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "max_model_len": 16384},
        concurrency=10, batch_size=64),
    "fixed_pool": dict(model_source=MODEL, concurrency=(4, 4), batch_size=64),
    # __cpu_inference_config_example__ (rst: "mp" executor, CPU-only placement group bundles)
    "cpu_inference": dict(model_source=MODEL, engine_kwargs={"distributed_executor_backend": "mp"},
                          placement_group_config={"bundles": [{"CPU": 1}]}, concurrency=1, batch_size=16),
    # __concurrent_batches_tuning_example__ (rst: max_concurrent_batches + max_tasks_in_flight_per_actor,
    # Ray 2.56+'s home of what older docs put in ``experimental``, which Ray 2.59+ refuses)
    "concurrent_batches": dict(model_source=MODEL, max_concurrent_batches=8,
                               max_tasks_in_flight_per_actor=16, concurrency=1, batch_size=32),
    # __row_level_fault_tolerance_config_example__ (rst)
    "continue_on_error": dict(model_source=MODEL, should_continue_on_error=True, concurrency=1, batch_size=32),
    # test_backward_compat.py: the multimodal stage declared off
    "text_only_stages": dict(model_source=MODEL, prepare_multimodal_stage=False),
    # gpu test_vllm_engine_proc.py
    "max_pending_requests": dict(model_source=MODEL, max_pending_requests=111, task_type="generate",
                                 runtime_env={"env_vars": {"RANDOM_ENV_VAR": "12345"}}, concurrency=4, batch_size=64),
}
# GPU-only or unsupported here: declaring them must not fail; building may raise ConfigError
# naming the setting (never TypeError / another exception).
DECLARED_MAY_REFUSE = {
    # __parallel_config_example__
    "parallel": dict(model_source=MODEL, engine_kwargs={
        "max_model_len": 16384, "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
        "enable_chunked_prefill": True, "max_num_batched_tokens": 2048},
        concurrency=1, batch_size=32, accelerator_type="L4"),
    # __cross_node_parallelism_config_example__
    "cross_node": dict(model_source=MODEL, engine_kwargs={
        "enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "max_model_len": 16384,
        "pipeline_parallel_size": 4, "tensor_parallel_size": 4, "distributed_executor_backend": "ray"},
        batch_size=32, concurrency=1),
    # __custom_placement_group_strategy_config_example__
    "placement_group": dict(model_source=MODEL, engine_kwargs={
        "enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "max_model_len": 16384,
        "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
        batch_size=32, concurrency=1,
        placement_group_config={"bundles": [{"GPU": 1}] * 4, "strategy": "STRICT_PACK"}),
    # __runai_config_example__ and __s3_config_example__
    "runai": dict(model_source=MODEL, engine_kwargs={"load_format": "runai_streamer", "max_model_len": 16384},
                  concurrency=1, batch_size=64),
    "s3": dict(model_source="s3://your-bucket/your-model-path/",
               engine_kwargs={"load_format": "runai_streamer", "max_model_len": 16384}, concurrency=1, batch_size=64),
    # __lora_config_example__ (+ dynamic_lora_loading_path, as Ray's LoRA tests give it)
    "lora": dict(model_source=MODEL, engine_kwargs={"enable_lora": True, "max_lora_rank": 32, "max_loras": 1,
                                                    "max_model_len": 16384}, concurrency=1, batch_size=32),
    "lora_dynamic_path": dict(model_source=MODEL, dynamic_lora_loading_path="s3://bucket/loras/",
                              engine_kwargs={"enable_lora": True, "max_lora_rank": 32}),
    # __embedding_config_example__ / __classification_config_example__ (declared in basic_llm_example)
    "embedding": dict(model_source=MODEL, task_type="embed", engine_kwargs=dict(
        enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=256, enforce_eager=True),
        batch_size=32, concurrency=1, apply_chat_template=False, detokenize=False),
    "classification": dict(model_source=MODEL, task_type="classify",
                           engine_kwargs=dict(max_model_len=512, enforce_eager=True),
                           batch_size=8, concurrency=1, apply_chat_template=False, detokenize=False),
}


@pytest.mark.parametrize("name", sorted(DECLARED_MUST_BUILD) + sorted(DECLARED_MAY_REFUSE))
def test_declared_configs_construct(name):
    """Declaring a config never fails (Ray checks nothing until the pipeline runs)."""
    from batchgen_data import vLLMEngineProcessorConfig

    vLLMEngineProcessorConfig(**{**DECLARED_MUST_BUILD, **DECLARED_MAY_REFUSE}[name])


@pytest.mark.parametrize("name", sorted(DECLARED_MUST_BUILD))
def test_declared_cpu_configs_build(name):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    build_processor(vLLMEngineProcessorConfig(**DECLARED_MUST_BUILD[name]))


@pytest.mark.parametrize("name", sorted(DECLARED_MAY_REFUSE))
def test_declared_gpu_or_unsupported_configs_build_or_name_the_setting(name):
    from batchgen_data import ConfigError, build_processor, vLLMEngineProcessorConfig

    kwargs = DECLARED_MAY_REFUSE[name]
    try:
        build_processor(vLLMEngineProcessorConfig(**kwargs))
    except ConfigError as error:
        plain = {"model_source", "engine_kwargs", "concurrency", "batch_size"}
        settings = [*kwargs.get("engine_kwargs", {}), *(k for k in kwargs if k not in plain)]
        assert any(s in str(error) for s in settings), error


# --- working-with-llms.rst "Per-stage configuration": stage dicts with batch_size/concurrency/num_cpus ---

def test_per_stage_dict_configs(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=MODEL,
        chat_template_stage={"enabled": True, "batch_size": 256, "concurrency": 4},
        tokenize_stage={"enabled": True, "batch_size": 512, "num_cpus": 0.5},
        detokenize_stage={"enabled": True, "concurrency": (2, 8)},
        batch_size=4,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["q"]}],
                                    sampling_params=dict(temperature=0.0, max_tokens=MAX_TOKENS)),
        postprocess=lambda row: dict(q=row["q"], resp=row["generated_text"]),
    )
    out = _run(processor, [{"q": q} for q in QUESTIONS[:2]])
    assert all(_text(r["resp"]) for r in out)


# --- tokenization_disaggregation_example.py: stages on, the engine does not detokenize,
#     the detokenize stage fills generated_text ---

def test_tokenization_disaggregated(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, engine_kwargs={"max_model_len": 4096}, concurrency=1,
                                       batch_size=4, tokenize_stage=True, detokenize_stage=True)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["item"]}],
                                    sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, detokenize=False)),
        postprocess=lambda row: dict(resp=row["generated_text"]),
    )
    out = _run(processor, ["Hello world!", "Good morning!"])
    assert all(_text(r["resp"]) for r in out), "the detokenize stage gives generated_text when the engine does not"


# --- tokenization_aggregation_example.py: TokenizerStageConfig / DetokenizeStageConfig off,
#     the engine detokenizes ---

def test_tokenization_aggregated_with_stage_config_classes(ray_cluster):
    from batchgen_data import (DetokenizeStageConfig, TokenizerStageConfig, build_processor,
                               vLLMEngineProcessorConfig)

    config = vLLMEngineProcessorConfig(model_source=MODEL, engine_kwargs={"max_model_len": 4096}, concurrency=1,
                                       batch_size=4, tokenize_stage=TokenizerStageConfig(enabled=False),
                                       detokenize_stage=DetokenizeStageConfig(enabled=False))
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["item"]}],
                                    sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, detokenize=True)),
        postprocess=lambda row: dict(resp=row["generated_text"]),
    )
    out = _run(processor, ["Hello world!", "Good evening!"])
    assert all(_text(r["resp"]) for r in out)


# --- gpu/processor/test_vllm_engine_proc.py (newer): ChatTemplateStageConfig with a custom template ---

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
CALC_MESSAGES = [{"role": "system", "content": "You are a calculator"}, {"role": "user", "content": "7 ** 3 = ?"}]


def _template_token_count(demo_path, messages, template=TEMPLATE) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_path))
    text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                         tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _calculator_rows():
    return [{"id": i} for i in range(3)]


def _calculator_preprocess(row):
    return dict(messages=[{"role": "system", "content": "You are a calculator"},
                          {"role": "user", "content": f"{row['id'] + 7} ** 3 = ?"}],
                sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, detokenize=False))


def test_chat_template_stage_config_class_with_custom_template(ray_cluster, demo_path):
    from batchgen_data import (ChatTemplateStageConfig, DetokenizeStageConfig, TokenizerStageConfig,
                               build_processor, vLLMEngineProcessorConfig)

    config = vLLMEngineProcessorConfig(
        model_source=MODEL,
        engine_kwargs=dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=2048,
                           max_model_len=2048, enforce_eager=True, distributed_executor_backend="mp"),
        batch_size=4, concurrency=1,
        chat_template_stage=ChatTemplateStageConfig(enabled=True, chat_template=TEMPLATE),
        tokenize_stage=TokenizerStageConfig(enabled=True),
        detokenize_stage=DetokenizeStageConfig(enabled=True),
    )
    processor = build_processor(config, preprocess=_calculator_preprocess,
                                postprocess=lambda row: {"resp": row["generated_text"], "id": row["id"],
                                                         "n_in": row["num_input_tokens"]})
    out = _run(processor, _calculator_rows())
    assert all(_text(r["resp"]) for r in out)
    assert {r["id"]: r["n_in"] for r in out}[0] == _template_token_count(demo_path, CALC_MESSAGES)


# --- gpu/processor/test_vllm_engine_proc.py (older) and the embedding/classification docs:
#     the legacy flags apply_chat_template / chat_template / tokenize / detokenize ---

def test_legacy_flags_with_custom_chat_template(ray_cluster, demo_path):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=MODEL,
        engine_kwargs=dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=2048,
                           max_model_len=2048, enforce_eager=True),
        batch_size=4, concurrency=1,
        apply_chat_template=True, chat_template=TEMPLATE, tokenize=True, detokenize=True,
    )
    processor = build_processor(config, preprocess=_calculator_preprocess,
                                postprocess=lambda row: {"resp": row["generated_text"], "id": row["id"],
                                                         "n_in": row["num_input_tokens"]})
    out = _run(processor, _calculator_rows())
    assert all(_text(r["resp"]) for r in out)
    assert {r["id"]: r["n_in"] for r in out}[0] == _template_token_count(demo_path, CALC_MESSAGES)


def test_legacy_no_chat_template_prompt_rows(ray_cluster):
    """gpu test_vllm_placement_group / autoscaling: apply_chat_template=False, tokenize=False,
    detokenize=False; prompt rows; the engine detokenizes (sampling_params detokenize=True)."""
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=MODEL, task_type="generate",
        engine_kwargs=dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=4096),
        tokenize=False, detokenize=False, concurrency=1, batch_size=4, apply_chat_template=False,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(prompt=f"You are a calculator. {row['id']} ** 3 = ?",
                                    sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, detokenize=True)),
        postprocess=lambda row: dict(resp=row["generated_text"]),
    )
    out = processor(ray.data.range(4)).take_all()
    assert len(out) == 4
    _no_errors(out)
    assert all(_text(r["resp"]) for r in out)


# --- build_processor(builder_kwargs=...): Ray hands them to the config's builder
#     (vLLM's takes chat_template_kwargs) ---

def test_builder_kwargs_chat_template_kwargs(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, concurrency=1, batch_size=4)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["q"]}],
                                    sampling_params=dict(temperature=0.0, max_tokens=MAX_TOKENS)),
        postprocess=lambda row: dict(q=row["q"], resp=row["generated_text"]),
        builder_kwargs=dict(chat_template_kwargs={"enable_thinking": False}),
    )
    out = _run(processor, [{"q": q} for q in QUESTIONS[:2]])
    assert all(_text(r["resp"]) for r in out)


# --- rst "Tuning concurrent batch processing" / gpu test: max_tasks_in_flight_per_actor,
#     autoscaling concurrency, preprocess/postprocess map kwargs ---

def test_concurrent_batches_tuning_and_map_kwargs(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, engine_kwargs={"max_model_len": 4096},
                                       concurrency=(1, 1), batch_size=2, max_concurrent_batches=4,
                                       max_tasks_in_flight_per_actor=4)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["q"]}],
                                    sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, top_p=0.9)),
        postprocess=lambda row: dict(q=row["q"], resp=row["generated_text"]),
        preprocess_map_kwargs={"num_cpus": 0.25},
        postprocess_map_kwargs={"num_cpus": 0.25},
    )
    out = _run(processor, [{"q": q} for q in QUESTIONS])
    assert all(_text(r["resp"]) for r in out)


# --- rst "Row-level fault tolerance": should_continue_on_error=True; large carried columns ---

def test_row_level_fault_tolerance_and_carried_columns(ray_cluster):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, concurrency=1, batch_size=4, should_continue_on_error=True)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            carried="x" * 10_000,  # as gpu test_async_udf_queue_capped's large_memory_to_carry_over
            messages=[{"role": "user", "content": row["q"]}],
            sampling_params=dict(temperature=0.3, max_tokens=row["max_tokens"], ignore_eos=True)),
        postprocess=lambda row: {"resp": row["generated_text"], "saw_carried": "carried" in row, "id": row["id"]},
    )
    items = [{"id": i, "q": q, "max_tokens": MAX_TOKENS} for i, q in enumerate(QUESTIONS[:3])]
    items.append({"id": 9, "q": "bad row", "max_tokens": 0})
    out = {r["id"]: r for r in processor(ray.data.from_items(items)).take_all()}
    assert sorted(out) == [0, 1, 2, 9]
    # an error row skips postprocess: it comes out whole (postprocess's columns None where the block
    # holds success rows too)
    assert "max_tokens" in out[9][ERROR] and out[9].get("resp") is None and out[9]["q"] == "bad row"
    _no_errors([out[i] for i in (0, 1, 2)])
    assert all(_text(out[i]["resp"]) and out[i]["saw_carried"] for i in (0, 1, 2))


# --- the three input block formats (pandas, Arrow, Python rows) into one processor ---

def test_pandas_arrow_and_python_blocks(ray_cluster):
    import pandas as pd
    import pyarrow as pa

    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, concurrency=1, batch_size=2)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["text"]}],
                                    sampling_params=dict(temperature=0.0, max_tokens=MAX_TOKENS)),
        postprocess=lambda row: dict(src=row["src"], resp=row["generated_text"]),
    )
    ds = ray.data.from_pandas(pd.DataFrame({"src": ["pandas"] * 2, "text": QUESTIONS[:2]}))
    ds = ds.union(ray.data.from_arrow(pa.table({"src": ["arrow"] * 2, "text": QUESTIONS[2:]})))
    ds = ds.union(ray.data.from_items([{"src": "items", "text": t} for t in QUESTIONS[:2]]))
    out = processor(ds).take_all()
    assert sorted(r["src"] for r in out) == sorted(["pandas"] * 2 + ["arrow"] * 2 + ["items"] * 2)
    _no_errors(out)
    assert all(_text(r["resp"]) for r in out)


# --- custom_tokenizer_example.py: built-in stages off, the user's own chat template / tokenize /
#     detokenize map_batches around the processor; rows reach it with tokenized_prompt + messages ---

def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _own_chat_template(batch, model_path: str):
    tokenizer = _tokenizer(model_path)
    all_messages = [m.tolist() if hasattr(m, "tolist") else list(m) for m in batch["messages"]]
    prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in all_messages]
    return {"prompt": prompts, "messages": all_messages, "sampling_params": list(batch["sampling_params"])}


def _own_tokenize(batch, model_path: str):
    tokenizer = _tokenizer(model_path)
    return {"tokenized_prompt": [tokenizer.encode(p) for p in batch["prompt"]],
            "messages": list(batch["messages"]), "sampling_params": list(batch["sampling_params"])}


def _own_detokenize(batch, model_path: str):
    tokenizer = _tokenizer(model_path)
    decoded = [tokenizer.decode(list(t), skip_special_tokens=True) for t in batch["generated_tokens"]]
    return {**batch, "generated_text_custom": decoded}


def test_custom_tokenizer_stages_around_the_processor(ray_cluster, demo_path):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    items = [{"messages": [{"role": "user", "content": q}],
              "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.7}} for q in QUESTIONS[:2]]
    config = vLLMEngineProcessorConfig(
        model_source=MODEL,
        engine_kwargs=dict(max_model_len=4096, trust_remote_code=True, tokenizer_mode="auto"),
        batch_size=4, concurrency=1,
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False,
    )
    processor = build_processor(
        config,
        postprocess=lambda row: {
            "generated_text": row.get("generated_text", ""),
            "generated_tokens": row.get("generated_tokens", []),
            "num_input_tokens": row.get("num_input_tokens", 0),
            "num_generated_tokens": row.get("num_generated_tokens", 0),
        },
        postprocess_map_kwargs={"num_cpus": 0.2},
    )
    # Ray's example runs these as callable classes (actor pools); tasks keep this 2-CPU run small
    stage = dict(fn_kwargs={"model_path": str(demo_path)}, batch_size=4, num_cpus=0.25)
    ds = ray.data.from_items(items)
    ds = ds.map_batches(_own_chat_template, **stage)
    ds = ds.map_batches(_own_tokenize, **stage)
    ds = processor(ds)
    ds = ds.map_batches(_own_detokenize, **stage)
    out = ds.take_all()
    assert len(out) == len(items)
    _no_errors(out)
    expected_lengths = sorted(_template_token_count(demo_path, i["messages"], template=None) for i in items)
    assert sorted(int(r["num_input_tokens"]) for r in out) == expected_lengths  # the tokenized_prompt ran
    for row in out:
        assert int(row["num_generated_tokens"]) == len(row["generated_tokens"]) > 0
        assert _text(row["generated_text_custom"]) and _text(row["generated_text"])


# --- embedding_example.py / classification_example.py: task_type embed / classify, prompt rows,
#     legacy flags, postprocess reads "embeddings" ---

def test_embedding_example(ray_cluster):
    from batchgen_data import build_llm_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=MODEL, task_type="embed",
        engine_kwargs=dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=256,
                           enforce_eager=True),
        batch_size=4, concurrency=1, apply_chat_template=False, detokenize=False,
    )
    processor = build_llm_processor(config, preprocess=lambda row: dict(prompt=row["text"]),
                                    postprocess=lambda row: {"text": row["prompt"], "embedding": row["embeddings"]})
    texts = ["Hello world", "A sentence to embed"]
    out = _run(processor, [{"text": t} for t in texts])
    assert sorted(r["text"] for r in out) == sorted(texts)
    assert all(len(r["embedding"]) > 0 for r in out)


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory):
    """A tiny random sequence-classification checkpoint (the docs' model is a classifier)."""
    from tiny_checkpoints import build_classifier_checkpoint

    folder = tmp_path_factory.mktemp("doc-shapes-classifier")
    build_classifier_checkpoint("qwen3_moe", folder, num_labels=3, max_position_embeddings=1024)  # max_model_len 512
    return folder


def test_classification_example(ray_cluster, classifier_path):
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=str(classifier_path), task_type="classify",
                                       engine_kwargs=dict(max_model_len=512, enforce_eager=True),
                                       batch_size=4, concurrency=1, apply_chat_template=False, detokenize=False)
    processor = build_processor(
        config, preprocess=lambda row: dict(prompt=row["text"]),
        postprocess=lambda row: {"text": row["prompt"],
                                 "score": float(row["embeddings"][0])
                                 if row.get("embeddings") is not None and len(row["embeddings"]) > 0 else None})
    out = _run(processor, [{"text": t} for t in ["lol so funny", "Photosynthesis converts light to energy."]])
    assert all(isinstance(r["score"], float) for r in out)


# --- serve_deployment_example.py / shared-engine test / autoscaling no-starvation test:
#     two processors chained, the second reading the first's output (multi-turn) ---

@pytest.mark.timeout(45)  # today it hangs: each processor's actor takes a whole CPU of the 2 (see below)
def test_two_processors_chained_multi_turn(ray_cluster):
    """Two processors in one pipeline: with each engine actor's default CPU share computed for its
    own processor alone (1 CPU of 2 here), the two actors hold every CPU and the read / postprocess
    tasks never start (with num_cpus=0.5 each the same pipeline ran in 14 s)."""
    from batchgen_data import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source=MODEL, chat_template_stage=False, tokenize_stage=False,
                                       detokenize_stage=False, batch_size=4, concurrency=(1, 1))
    first = build_processor(
        config,
        preprocess=lambda row: dict(prompt=f"Calculate {row['id']} ** 2 = ",
                                    sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, detokenize=True)),
        postprocess=lambda row: {"resp_1": row["generated_text"], "id": row.get("id", None)},
    )
    second = build_processor(
        config,
        preprocess=lambda row: dict(**row, prompt=f"Previous result: {row.get('resp_1', 'N/A')}. Now its cube: ",
                                    sampling_params=dict(temperature=0.3, max_tokens=MAX_TOKENS, detokenize=True)),
        postprocess=lambda row: {**row, "resp_2": row["generated_text"]},
    )
    out = second(first(ray.data.range(3))).take_all()
    assert len(out) == 3
    _no_errors(out)
    assert sorted(r["id"] for r in out) == [0, 1, 2]
    assert all(_text(r["resp_1"]) and _text(r["resp_2"]) for r in out)
