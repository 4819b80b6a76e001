"""A node removed mid-job (two-node ``ray.cluster_utils.Cluster`` on one machine) loses no row."""

from __future__ import annotations

import os
import time

import pytest
from fault_helpers import (
    ENGINE_CONFIG,
    check_job_output,
    fault_rows,
    operator_pids,
    reference_texts,
    run_in_thread,
    wait_for,
)

from batchgen_data import BatchGenOperator

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    # The driver attaches to the head's raylet only if it is the one node at init time.
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"BATCHGEN_DATA_CACHE": os.environ["BATCHGEN_DATA_CACHE"], "DS_ACCELERATOR": "cpu"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_removing_a_node_mid_job_keeps_every_row_exactly_once(cluster, demo_path):
    worker = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    rows = fault_rows()
    expected = reference_texts(demo_path, rows)
    ds = ray.data.from_items(rows).repartition(8).map_batches(
        BatchGenOperator,
        fn_constructor_kwargs={"model": str(demo_path), "engine_config": ENGINE_CONFIG, "lease_timeout_s": 5.0},
        batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2),
        num_cpus=0.75,  # the 1-CPU head fits one actor: the other runs on the node we remove
    )
    thread, box = run_in_thread(ds.take_all)
    wait_for(lambda: len(operator_pids()) >= 2, 120, "two operator actors")
    time.sleep(3.0)
    cluster.remove_node(worker, allow_graceful=False)
    cluster.add_node(num_cpus=2)  # replacement capacity, as an autoscaler would add
    check_job_output(thread, box, rows, expected)
