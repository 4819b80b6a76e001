"""Hugging Face datasets ``.map`` with ``BatchGenMap``: same rows as the engine, cached, multi-process."""

from __future__ import annotations

import datasets
import pytest
from batchgen_data.operators import OUTPUT_COLUMNS
from stage_rows import ENGINE_CONFIG, MAX_TOKENS, check_output_rows, mixed_rows

from batchgen_data import BatchGenMap


@pytest.fixture()
def dataset(tmp_path):
    rows = mixed_rows()
    # Save to disk so .map writes (and reuses) cache files, as with a real dataset.
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    return datasets.load_from_disk(str(tmp_path / "ds"))


def _fn(demo_path):
    return BatchGenMap(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=MAX_TOKENS)


def test_map_gives_engine_outputs_and_error_rows(dataset, demo_path, reference_outputs):
    out = dataset.map(_fn(demo_path), batched=True, batch_size=4)
    assert set(OUTPUT_COLUMNS) <= set(out.column_names)
    assert out["id"] == dataset["id"]
    check_output_rows(out.to_list(), reference_outputs)


def test_second_identical_map_reuses_the_cache(dataset, demo_path):
    first = dataset.map(_fn(demo_path), batched=True, batch_size=4)
    second = dataset.map(_fn(demo_path), batched=True, batch_size=4)
    assert first._fingerprint == second._fingerprint
    assert first.cache_files and first.cache_files == second.cache_files


def test_map_with_two_processes(dataset, demo_path, reference_outputs):
    out = dataset.map(_fn(demo_path), batched=True, batch_size=3, num_proc=2)
    check_output_rows(out.to_list(), reference_outputs)


def test_iterable_dataset_map(dataset, demo_path, reference_outputs):
    iterable = dataset.to_iterable_dataset(num_shards=2)
    rows = list(iterable.map(_fn(demo_path), batched=True, batch_size=4))
    assert sorted(r["id"] for r in rows) == sorted(dataset["id"])
    check_output_rows(rows, reference_outputs)


def test_typed_generated_json_column_through_datasets(demo_path):
    import pyarrow as pa
    from structured_rows import SCHEMA, check_generated_json

    from batchgen_data.operators.json_column import json_column_type

    rows = [{"prompt": f"Review {i}: the soup was cold."} for i in range(6)]
    rows[1]["prompt"] = ""  # an error row: null
    fn = BatchGenMap(model=str(demo_path), engine_config=ENGINE_CONFIG, max_tokens=48,
                     structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    ds = datasets.Dataset.from_list(rows).with_format("arrow")  # arrow batches keep the column's type
    out = ds.map(fn, batched=True, batch_size=3)
    assert out.features["generated_json"] == datasets.Features.from_arrow_schema(
        pa.schema([("generated_json", json_column_type(SCHEMA))]))["generated_json"]
    result = out.with_format(None).to_list()
    assert result[1]["finish_reason"] == "error"
    check_generated_json(result)
