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
    """The actor's engine spreads the experts over two rank processes of its own: every row once,
    the same rows as one process gives (the actor's fractional CPU is shared by its ranks)."""
    rows = mixed_rows()
    config = {**ENGINE_CONFIG, "expert_parallel_size": 2}
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
