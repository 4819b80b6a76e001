"""A killed operator actor loses no row and duplicates none (real local Ray, bounded in time)."""

from __future__ import annotations

import time

import pytest
from fault_helpers import (
    ENGINE_CONFIG,
    check_job_output,
    fault_rows,
    operator_pids,
    reference_texts,
    run_in_thread,
    sigkill,
    wait_for,
)

from batchgen_data import BatchGenOperator

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)


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
    check_job_output(thread, box, rows, expected)
