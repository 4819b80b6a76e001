"""How Ray-placed ranks are checked against a cluster and numbered (no Ray started)."""

from __future__ import annotations

import pytest

from batchgen_data import ConfigError, EngineConfig
from batchgen_data.engine.executor.rank_actor import RankPlace
from batchgen_data.engine.executor.rank_backend import rank_backend
from batchgen_data.engine.executor.ray_rank_group import (
    bundles_per_node,
    check_placeable,
    core_plan,
    node_order,
    rank_bundle,
)

NODES = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 4.0}, {"CPU": 1.0}]


def test_bundles_per_node_counts_whole_bundles_by_the_scarcest_resource():
    assert bundles_per_node({"CPU": 2, "GPU": 1}, NODES) == [2, 2, 0]
    assert bundles_per_node({"CPU": 0.5}, NODES) == [16, 8, 2]
    assert bundles_per_node({"CPU": 1, "ep_slot": 1}, NODES) == [0, 0, 0]


@pytest.mark.parametrize(("ranks", "strategy", "fits"), [
    (4, "PACK", True), (5, "PACK", False), (2, "STRICT_PACK", True), (3, "STRICT_PACK", False),
    (2, "STRICT_SPREAD", True), (3, "STRICT_SPREAD", False), (4, "SPREAD", True),
])
def test_a_group_is_refused_only_when_no_state_of_the_cluster_holds_it(ranks, strategy, fits):
    bundle = {"CPU": 2, "GPU": 1}
    if fits:
        check_placeable(bundle, ranks, strategy, NODES)
    else:
        with pytest.raises(ConfigError, match=r"do not fit this Ray cluster: its 3 node\(s\) hold \[2, 2, 0\]"):
            check_placeable(bundle, ranks, strategy, NODES)


def test_ranks_are_numbered_by_node_so_a_nodes_ranks_are_consecutive():
    places = [RankPlace(node, "10.0.0.1", pid) for pid, node in enumerate(["b", "a", "b", "c", "a"])]
    assert node_order(places) == [0, 2, 1, 4, 3]  # node b first (bundle 0), then a, then c


def test_ranks_bind_to_the_whole_cpus_their_bundles_add_up_to_on_a_machine():
    cpu = EngineConfig(device="cpu")
    assert core_plan(cpu, {"CPU": 2}, 3) == (6, 2)  # each rank its own two cores
    assert core_plan(cpu, {"CPU": 0.5}, 2) == (1, None)  # two half-CPU ranks share one core
    assert core_plan(cpu, {"CPU": 0.25}, 2) == (0, None)  # less than a core: unbound
    assert core_plan(cpu, {"CPU": 1.5}, 2) == (3, None)
    assert core_plan(EngineConfig(device="cpu", bind_rank_cpus=False), {"CPU": 2}, 1) == (0, None)


def test_the_default_bundle_and_backend():
    assert rank_bundle(EngineConfig(device="cpu")) == {"CPU": 1.0}
    assert rank_bundle(EngineConfig(rank_resources={"CPU": 3, "GPU": 1})) == {"CPU": 3, "GPU": 1}
    assert rank_backend(EngineConfig(distributed_executor_backend="mp")) == "mp"
    assert rank_backend(EngineConfig(distributed_executor_backend="ray")) == "ray"


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_ranks_claim_cores_no_live_rank_holds_and_reclaim_dead_ones(tmp_path):
    import json
    import os

    from batchgen_data.engine.executor.rank_resources import _identity, claim_cpus, hold_cpus

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    registry = tmp_path / "cpus.json"
    # A live process (our parent) holds the first CPU; a dead one (pid 2**22 + 1, never live) the second.
    registry.write_text(json.dumps({_identity(os.getppid()): [cpus[0]], f"{2**22 + 1}:1": [cpus[1]]}))
    try:
        assert claim_cpus(1, registry) == (cpus[1],)  # the dead process's core is free again
        assert os.sched_getaffinity(0) == {cpus[1]}
        held = json.loads(registry.read_text())
        assert held == {_identity(os.getppid()): [cpus[0]], _identity(os.getpid()): [cpus[1]]}
        assert claim_cpus(len(cpus), registry) == ()  # not that many free: left unpinned
        hold_cpus((cpus[0],), registry)  # a rank binding to its group's share records it too
        assert os.sched_getaffinity(0) == {cpus[0]} and json.loads(registry.read_text())[_identity(os.getpid())] == [cpus[0]]
    finally:
        os.sched_setaffinity(0, cpus)
