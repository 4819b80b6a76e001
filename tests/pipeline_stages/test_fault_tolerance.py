"""A killed operator actor loses no row and duplicates none (real local Ray, bounded in time)."""

from __future__ import annotations

import os
import time

import pytest

from batchgen_data import BatchGenOperator

from .fault_helpers import (
    ENGINE_CONFIG,
    fault_rows,
    operator_pids,
    reference_texts,
    run_in_thread,
    sigkill,
    wait_for,
)

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             log_to_driver=False,
             runtime_env={"env_vars": {"BATCHGEN_DATA_CACHE": os.environ["BATCHGEN_DATA_CACHE"], "DS_ACCELERATOR": "cpu"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def _pipeline(demo_path, rows, rebalance=None):
    return ray.data.from_items(rows).repartition(8).map_batches(
        BatchGenOperator,
        fn_constructor_kwargs={"model": str(demo_path), "engine_config": ENGINE_CONFIG, "rebalance": rebalance,
                               "lease_timeout_s": 5.0},
        batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2),
        num_cpus=0.5,
    )


@pytest.mark.parametrize("rebalance", [True, False])
def test_sigkill_of_an_operator_actor_loses_and_duplicates_nothing(ray_cluster, demo_path, rebalance):
    rows = fault_rows()
    expected = reference_texts(demo_path, rows)
    thread, box = run_in_thread(lambda: _pipeline(demo_path, rows, rebalance).take_all())
    wait_for(lambda: len(operator_pids()) >= 2, 120, "two operator actors")
    time.sleep(4.0)  # let them take batches and lease work
    victim = operator_pids()[0]
    sigkill(victim)
    thread.join(240)
    assert not thread.is_alive(), "the job did not finish after the actor was killed"
    assert "error" not in box, box.get("error")
    out = box["result"]
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]  # every row exactly once
    assert {r["id"]: r["generated_text"] for r in out} == expected
    assert all(r["__inference_error__"] is None for r in out)
