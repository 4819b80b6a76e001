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
