"""Ray Data with ``BatchGenOperator`` on a real local Ray cluster (one per module, timeouts everywhere)."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from stage_rows import BAD_ROWS, ENGINE_CONFIG, MAX_TOKENS, check_output_rows, mixed_rows

from batchgen_data import BatchGenOperator

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(240)


def _run(ds, demo_path, *, actors=1, batch_size=4, concurrency=2, batch_format="default", **kwargs):
    return ds.map_batches(
        BatchGenOperator,
        fn_constructor_kwargs={"model": str(demo_path), "engine_config": ENGINE_CONFIG, "max_tokens": MAX_TOKENS, **kwargs},
        batch_size=batch_size,
        batch_format=batch_format,
        compute=ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=concurrency),
        num_cpus=0.5,  # whole CPUs would starve the read task on 2 cores and hang
    )


def test_pipeline_equals_engine_with_error_rows(ray_cluster, demo_path, reference_outputs):
    ds = ray.data.from_items(mixed_rows())
    rows = _run(ds, demo_path).take_all()
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in mixed_rows())
    check_output_rows(rows, reference_outputs)


@pytest.mark.parametrize("batch_format", ["pyarrow", "pandas", "numpy"])
def test_batch_formats_and_order_within_batch(ray_cluster, demo_path, reference_outputs, batch_format):
    rows = mixed_rows()
    ds = ray.data.from_arrow(pa.Table.from_pylist(rows))
    out = _run(ds, demo_path, batch_size=len(rows), batch_format=batch_format).take_all()
    assert [r["id"] for r in out] == [r["id"] for r in rows]  # one batch: input order kept
    check_output_rows(out, reference_outputs)


def test_two_actors_and_parquet_roundtrip(ray_cluster, demo_path, reference_outputs, tmp_path):
    rows = mixed_rows() * 3
    for i, r in enumerate(rows):
        r = dict(r)
        rows[i] = {**r, "id": r["id"], "copy": i // len(mixed_rows())}
    ds = ray.data.from_items(rows).repartition(4)
    _run(ds, demo_path, actors=2).write_parquet(str(tmp_path / "out"))
    out = ray.data.read_parquet(str(tmp_path / "out")).take_all()
    assert len(out) == len(rows)
    assert sorted((r["copy"], r["id"]) for r in out) == sorted((r["copy"], r["id"]) for r in rows)
    check_output_rows(out, reference_outputs)
    assert sum(1 for r in out if r["__inference_error__"]) == 3 * len(BAD_ROWS)


def test_one_actor_over_two_expert_parallel_ranks(ray_cluster, demo_path, reference_outputs):
    """The actor's engine spreads the experts over two rank actors in a placement group of its
    own (Ray is initialized in the actor: Ray-placed ranks, sized by Ray Data LLM's
    placement_group_config): every row once, the same rows as one process gives."""
    from batchgen_data.processor import vLLMEngineProcessorConfig

    rows = mixed_rows()
    placement = vLLMEngineProcessorConfig(
        model_source="demo", engine_kwargs={"expert_parallel_size": 2},
        placement_group_config={"bundles": [{"CPU": 0.25}] * 2, "strategy": "PACK"}).rank_placement()
    assert placement == {"rank_resources": {"CPU": 0.25, "GPU": 0}, "placement_strategy": "PACK"}
    config = {**ENGINE_CONFIG, "expert_parallel_size": 2, **placement}
    out = _run(ray.data.from_items(rows), demo_path, engine_config=config).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    check_output_rows(out, reference_outputs)


class _DiesOnceOperator(BatchGenOperator):
    """The first actor's engine fails mid-batch (a fatal engine error), later actors are healthy."""

    def __init__(self, marker: str, **kwargs):
        super().__init__(**kwargs)
        if not os.path.exists(marker):
            open(marker, "w").close()
            engine = self.engine.engine

            def broken_step():
                raise RuntimeError("simulated device failure")

            engine.step = broken_step


def test_engine_death_restarts_the_actor_and_retries_the_batch(ray_cluster, demo_path, reference_outputs, tmp_path):
    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test module is not installed
    rows = mixed_rows()
    ds = ray.data.from_items(rows)
    out = ds.map_batches(
        _DiesOnceOperator,
        fn_constructor_kwargs={"marker": str(tmp_path / "died"), "model": str(demo_path),
                               "engine_config": ENGINE_CONFIG, "max_tokens": MAX_TOKENS},
        batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=2),
        num_cpus=0.5,
    ).take_all()
    assert (tmp_path / "died").exists()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)  # each row exactly once
    check_output_rows(out, reference_outputs)


def test_guided_decoding_rows_through_ray_data(ray_cluster, demo_path):
    from structured_rows import check_guided_rows, guided_rows

    out = _run(ray.data.from_items(guided_rows()), demo_path, batch_size=4).take_all()
    check_guided_rows(out)


def test_build_processor_gives_the_operators_rows_with_preprocess_and_postprocess(ray_cluster, demo_path,
                                                                                  reference_outputs):
    """A Ray Data LLM pipeline with its import and config class changed."""
    from stage_rows import GOOD_ROWS

    from batchgen_data import BatchGenProcessorConfig, build_processor

    config = BatchGenProcessorConfig(model_source=str(demo_path), engine_kwargs=ENGINE_CONFIG, batch_size=4,
                                     concurrency=1, max_concurrent_batches=2, num_cpus=0.5)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(prompt=row["text"], sampling_params={  # Arrow gives unset keys as None
            "temperature": 0.0, "max_tokens": MAX_TOKENS,
            **{k: v for k, v in (row["overrides"] or {}).items() if v is not None}}),
        postprocess=lambda row: dict(id=row["id"], answer=row["generated_text"], n=row["num_generated_tokens"],
                                     error=row["__inference_error__"]),
    )
    rows = [{"id": r["id"], "text": r["prompt"], "overrides": r.get("sampling_params")} for r in GOOD_ROWS]
    rows.append({"id": 99, "text": "ok", "overrides": {"max_tokens": 0}})  # a bad row
    with pytest.raises(Exception, match="max_tokens"):  # should_continue_on_error=False (Ray's default) fails
        processor(ray.data.from_items(rows)).take_all()
    config.should_continue_on_error = True
    out = {r["id"]: r for r in build_processor(config, processor.preprocess, processor.postprocess)(
        ray.data.from_items(rows)).take_all()}
    assert sorted(out) == sorted(r["id"] for r in rows)
    for good in GOOD_ROWS:
        assert out[good["id"]]["answer"] == reference_outputs[good["id"]].text
        assert out[good["id"]]["error"] == ""  # postprocess reads "" on success, as from Ray's stage
        assert out[good["id"]]["__inference_error__"] == ""  # Ray's one schema for continued jobs
    # An error row skips postprocess, as in Ray Data LLM: it comes out whole with its error kept
    # (it used to go through postprocess, which dropped the error: {'answer': None, ...}).
    assert out[99].get("answer") is None and "max_tokens" in out[99]["__inference_error__"]
    assert out[99]["text"] == "ok"


def test_processor_config_rejects_what_it_cannot_honour():
    import pydantic

    from batchgen_data import BatchGenProcessorConfig, ConfigError, build_processor

    declared = BatchGenProcessorConfig(model_source="demo", engine_kwargs={"tensor_parallel_size": 2})  # as Ray's
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 .*use expert_parallel_size"):
        build_processor(declared)
    with pytest.raises(pydantic.ValidationError, match="min > max"):
        BatchGenProcessorConfig(model_source="demo", concurrency=(3, 1))
    with pytest.raises(pydantic.ValidationError, match="template"):
        build_processor(BatchGenProcessorConfig(model_source="demo", chat_template_stage={"template": "x"}))
    config = BatchGenProcessorConfig(model_source="demo", concurrency=(1, 2),
                                     chat_template_stage={"chat_template_kwargs": {"enable_thinking": False}})
    assert config.operator_kwargs()["chat_template_kwargs"] == {"enable_thinking": False}
    assert config.operator_kwargs()["rebalance"] is True


def test_build_processor_rows_have_the_tables_columns(ray_cluster, demo_path):
    """Every column of the output table, in its order, with values of its types: Arrow types in
    the dataset's schema (logprobs too, not a pickled Python object column)."""
    import numpy as np

    from batchgen_data import BatchGenProcessorConfig, build_processor
    from batchgen_data.operators.columns import OUTPUT_COLUMNS, OUTPUT_SCHEMA

    config = BatchGenProcessorConfig(model_source=str(demo_path), engine_kwargs=ENGINE_CONFIG, batch_size=4,
                                     concurrency=1, max_concurrent_batches=2, num_cpus=0.5,
                                     should_continue_on_error=True)
    processor = build_processor(config, preprocess=lambda row: {"sampling_params": {
        "temperature": 0.0, "max_tokens": 2, "logprobs": 1, "prompt_logprobs": 0}})
    ds = processor(ray.data.from_items([{"id": 0, "prompt": "Hello there"}, {"id": 1, "prompt": ""}]))
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    schema = ds.schema()
    assert schema.names[-len(OUTPUT_COLUMNS):] == list(OUTPUT_COLUMNS)
    arrow = dict(zip(schema.names, schema.types))
    assert arrow["logprobs"] == OUTPUT_SCHEMA.field("logprobs").type
    assert arrow["metrics"] == OUTPUT_SCHEMA.field("metrics").type

    def plain(value):  # numpy arrays and scalars, as Ray hands them back, to Python
        if isinstance(value, np.ndarray):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value.item() if isinstance(value, np.generic) else value

    for name in OUTPUT_COLUMNS:
        pa.array([plain(row[name]) for row in rows], type=OUTPUT_SCHEMA.field(name).type)
    # Ray's values: "" on success (no postprocess: the whole row), the error on failure
    assert rows[1]["__inference_error__"] == "RowError: empty prompt in column 'prompt'" and rows[0]["__inference_error__"] == ""
    assert rows[0]["prompt"] == "Hello there" and rows[1]["request_id"] == -1 and rows[0]["request_id"] >= 0
    assert plain(rows[0]["logprobs"])[0][0]["token_id"] == plain(rows[0]["generated_tokens"])[0]
