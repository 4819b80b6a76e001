"""Pooling stages (``task_type="embed" | "classify"``, Ray Data LLM's): rows with an optional
``pooling_params`` dict come out with a ``list<float32>`` ``embeddings`` column in every batch
format, and through Parquet; generate stages leave the column null."""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchgen_data.operators.rows import StageConfig
from stage_rows import ENGINE_CONFIG

from batchgen_data import BatchGenMap, ConfigError, Engine, EngineConfig
from batchgen_data.engine.pooling_params import PoolingParams

ROWS = [
    {"id": 0, "prompt": "Embed: the blender broke after two days.", "pooling_params": None},
    {"id": 1, "prompt": "Embed: shipping took three weeks.", "pooling_params": {"normalize": False}},
    {"id": 2, "prompt": "", "pooling_params": None},  # a bad row
    {"id": 3, "prompt": "ok", "pooling_params": {"use_activation": False}},  # not an embed field
]
EMBEDDINGS = pa.list_(pa.float32())


@pytest.fixture(scope="module")
def expected(demo_path):
    engine = Engine(demo_path, EngineConfig(**ENGINE_CONFIG))
    return [engine.embed([ROWS[0]["prompt"]])[0].embeddings,
            engine.embed([ROWS[1]["prompt"]], PoolingParams(normalize=False))[0].embeddings]


def _check(values: list, errors: list, expected: list) -> None:
    for got, want in zip(values[:2], expected):
        np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.float32(want), atol=1e-5)
    assert values[2] is None and "empty prompt" in errors[2]
    assert values[3] is None and "invalid pooling_params" in errors[3]


@pytest.mark.parametrize("fmt", ["pyarrow", "pandas", "numpy", "dict"])
def test_every_batch_format_gets_the_embeddings(expected, fmt):
    stage = BatchGenMap(model="demo", engine_config=ENGINE_CONFIG, task_type="embed")
    table = pa.Table.from_pylist(ROWS)
    batch = {"pyarrow": table, "pandas": table.to_pandas(), "dict": table.to_pydict(),
             "numpy": {k: np.array(v, dtype=object) for k, v in table.to_pydict().items()}}[fmt]
    out = stage(batch)
    if fmt == "pyarrow":
        assert out.schema.field("embeddings").type == EMBEDDINGS
        out = out.to_pydict()
    elif fmt == "pandas":
        assert str(out["embeddings"].dtype) == "list<item: float>[pyarrow]"
        out = pa.Table.from_pandas(out).to_pydict()
    _check(list(out["embeddings"]), list(out["__inference_error__"]), expected)


def test_parquet_and_datasets_keep_the_column_typed(expected, tmp_path):
    config = dict(model="demo", engine_config=ENGINE_CONFIG, task_type="embed")
    table = BatchGenMap(**config)(pa.Table.from_pylist(ROWS))
    pq.write_table(table, tmp_path / "part.parquet")
    back = pq.read_table(tmp_path / "part.parquet")
    assert back.schema.field("embeddings").type == EMBEDDINGS
    _check(back.column("embeddings").to_pylist(), back.column("__inference_error__").to_pylist(), expected)
    mapped = datasets.Dataset.from_list(ROWS).map(BatchGenMap(**config), batched=True, batch_size=2)
    assert mapped.features["embeddings"].feature.dtype == "float32"
    _check(mapped["embeddings"], mapped["__inference_error__"], expected)


def test_generate_rows_have_null_embeddings_and_the_task_type_is_checked():
    out = BatchGenMap(model="demo", engine_config=ENGINE_CONFIG, max_tokens=2)({"prompt": ["Hello"]})
    assert out["embeddings"] == [None] and out["num_generated_tokens"] == [2]
    with pytest.raises(ConfigError, match="task_type must be one of"):
        StageConfig(task_type="score")
