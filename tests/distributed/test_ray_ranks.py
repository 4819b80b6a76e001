"""Expert-parallel ranks as Ray actors on a cluster of several nodes (``ray.cluster_utils.Cluster``:
separate raylets on this machine, custom resources so placement is observable): ranks on two
nodes give the tokens of one process and of ``transformers``; a Ray Data job over replicas of
two ranks each rebalances skew across the replicas; removing a rank's node mid-job ends its group
promptly and every row comes out exactly once. Every engine is closed and every rank process
checked gone, also when a test fails."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from fault_helpers import operator_pids, run_in_thread, wait_for
from tiny_checkpoints import hf_greedy_continuations

from batchgen_data import BatchGenOperator, ConfigError, Engine, EngineConfig, SamplingParams
from batchgen_data.engine.core.sequence import SequenceStatus

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.timeout(300)

EP_NODES = 3  # worker nodes with one "ep_slot" each: STRICT_SPREAD ranks land one per node
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99]]
MAX_NEW = 12
ON_TWO_NODES = {"placement_strategy": "STRICT_SPREAD", "rank_resources": {"CPU": 0.25, "ep_slot": 1}}


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _reap(pids: list[int]) -> None:
    """Kill what is left of these processes (a failed test's ranks) and assert they were gone."""
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"rank processes {left} outlived their engine"


def _rank_pids() -> list[int]:
    """PIDs of the processes Ray titles as rank actors (any engine's)."""
    pids = []
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            try:
                with open(f"/proc/{proc}/cmdline", "rb") as f:
                    if b"ray::RankActor" in f.read():
                        pids.append(int(proc))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Node death is noticed within ~2 s (the default is ~30 s) so the removal test stays short.
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                           "health_check_timeout_ms": 500}})
    env_vars = {k: os.environ[k] for k in ("BATCHGEN_DATA_CACHE", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")}
    try:
        # The driver attaches to the head's raylet only if it is the one node at init time.
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env_vars})
        ray.data.DataContext.get_current().enable_progress_bars = False
        for _ in range(EP_NODES):
            cluster.add_node(num_cpus=1, resources={"ep_slot": 1})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        _reap(_rank_pids())


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoint):
    return tiny_checkpoint("mixtral")


def _one_thread_tokens(folder, prompts, params) -> list[list[int]]:
    """One process, one torch thread: as the ranks (a fractional-CPU bundle runs one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(folder, EngineConfig(block_size=8)) as engine:
            return [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        torch.set_num_threads(threads)


def test_a_group_the_cluster_cannot_hold_is_a_config_error_before_anything_starts(cluster, mixtral):
    folder, _ = mixtral
    config = EngineConfig(expert_parallel_size=4, placement_strategy="STRICT_SPREAD",
                          rank_resources={"CPU": 0.25, "ep_slot": 1})
    with pytest.raises(ConfigError, match=r"do not fit this Ray cluster.*\[0, 1, 1, 1\]|do not fit this Ray cluster"):
        Engine(folder, config)
    assert not _rank_pids()


def test_ranks_on_two_nodes_give_the_tokens_of_one_process_and_of_transformers(cluster, mixtral):
    folder, model = mixtral
    ep_nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()
                if n["Alive"] and n["Resources"].get("ep_slot")}
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, max_num_seqs=4, **ON_TWO_NODES))
    pids = engine.executor.group.pids
    try:
        group = engine.executor.group
        assert type(group).__name__ == "RayRankGroup"  # Ray is initialized here: Ray-placed ranks
        assert len(set(group.node_ids)) == 2 and set(group.node_ids) <= set(ep_nodes)
        # Rank 0's rendezvous address is the one Ray reaches its node at.
        assert group.places[0].node_ip == ep_nodes[group.node_ids[0]]
        handles = [engine.add_request(p, _greedy()) for p in PROMPTS]
        for _ in range(3):
            engine.step()
        # The caller's handles follow what the ranks publish (not a driver copy left WAITING).
        assert sum(h.status is SequenceStatus.RUNNING and h.num_generated > 0 for h in handles) >= 4
        # MIGRATE out of the group with its KV (from the rank over its connection), as the
        # rebalancer does when shipping is cheaper than recomputing.
        moved = engine.export_sequence(handles[0], with_kv=True)
        assert moved.kv is not None and 0 < len(moved.output_token_ids) < MAX_NEW
        while engine.has_unfinished_requests():
            engine.step()
        got = [h.output.token_ids for h in handles[1:]]
    finally:
        engine.close()
    _reap(pids)
    got = [_continue_in_one_process(folder, moved)] + got
    assert got == _one_thread_tokens(folder, PROMPTS, _greedy())
    assert got == hf_greedy_continuations(model, PROMPTS, MAX_NEW)


def _continue_in_one_process(folder, state) -> list[int]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(folder, EngineConfig(block_size=8)) as engine:
            handle = engine.import_sequence(state)
            while engine.has_unfinished_requests():
                engine.step()
            return handle.output.token_ids
    finally:
        torch.set_num_threads(threads)


def _live_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_ranks_and_their_placement_group_end_when_the_engines_process_is_killed(cluster, mixtral):
    """The rank actors are detached (a placement group made by an actor outlives it), so they
    must end themselves: SIGKILL of the process holding the engine closes their lifeline."""
    import subprocess
    import sys

    folder, _ = mixtral
    code = (
        "import ray, time; from batchgen_data import Engine, EngineConfig;"
        f"ray.init(address={cluster.address!r}, log_to_driver=False);"
        f"e = Engine({str(folder)!r}, EngineConfig(expert_parallel_size=2, block_size=8, "
        "rank_resources={'CPU': 0.25}));"
        "print(*e.executor.group.pids, flush=True); time.sleep(600)"
    )
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert _live_groups()
        driver.kill()
        driver.wait(10)
        wait_for(lambda: not any(_alive(pid) for pid in pids), 30, "the ranks to end")
        wait_for(lambda: not _live_groups(), 30, "the placement group to be removed")
    finally:
        driver.kill()
        _reap(pids)


def _skew_rows() -> list[dict]:
    # Eight long rows in the first block, eight short ones in the second (the skew).
    return [{"id": i, "prompt": f"Ticket {i}: the courier left parcel {i * 7} at the wrong door.",
             "sampling_params": {"max_tokens": 96 if i < 8 else 4 * (i - 7), "ignore_eos": True}}
            for i in range(16)]


def _reference(folder, rows) -> dict[int, list[int]]:
    params = [SamplingParams(temperature=0.0, **r["sampling_params"]) for r in rows]
    return dict(zip((r["id"] for r in rows), _one_thread_tokens(folder, [r["prompt"] for r in rows], params)))


def test_two_replicas_of_two_ray_ranks_rebalance_skew_across_replicas(cluster, mixtral, tmp_path):
    """Two engine actors, each over two rank actors: the long rows of the first block queue on
    their engine (a small KV pool per rank), go to the stage's pool, and the other replica takes
    some; every row comes out once with the tokens of one process."""
    folder, _ = mixtral
    rows = _skew_rows()
    expected = _reference(folder, rows)
    engine_config = {"block_size": 8, "max_num_seqs": 2, "max_num_batched_tokens": 256, "expert_parallel_size": 2,
                     "rank_resources": {"CPU": 0.25}}
    before = set(_rank_pids())
    try:
        out = ray.data.from_items(rows, override_num_blocks=2).map_batches(
            BatchGenOperator,
            fn_constructor_kwargs={"model": str(folder), "engine_config": engine_config, "rebalance": True,
                                   "stats_dir": str(tmp_path)},
            batch_size=8,
            compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=1,
                                               max_tasks_in_flight_per_actor=1),
            num_cpus=0.25,
        ).take_all()
    finally:
        _reap([p for p in _rank_pids() if p not in before])
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]  # every row exactly once
    assert {r["id"]: list(r["generated_tokens"]) for r in out} == expected
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("actor-*.json")]
    assert len(reports) == 2, "both replicas should have taken part"
    [pool] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("batchgen-pool-")]
    counters = ray.get(ray.get_actor(pool["name"], namespace=pool["namespace"]).counters.remote())
    # Rows went through the pool, and the replica without the long rows took some of them.
    # The actors Ray Data ends take their rank groups with them (no placement group left holding bundles).
    wait_for(lambda: not _live_groups(), 30, "the replicas' placement groups to be removed")
    print("pool counters", counters, "run for others", [r["rebalance"]["num_run_for_others"] for r in reports])
    assert counters["num_submitted"] >= 4, counters
    assert sum(r["rebalance"]["num_run_for_others"] for r in reports) > 0, [r["rebalance"] for r in reports]
    assert counters["num_moves_planned"] == counters["num_migrated"], counters


def test_cli_job_on_a_cluster_runs_its_engines_over_ray_placed_ranks(cluster, mixtral, tmp_path):
    """``--address`` (here: the Ray this process joined) with ``--workers 2`` and
    ``--expert-parallel-size 2``: two engine actors over two rank actors each; every row once
    with the tokens of one process."""
    import pyarrow.parquet as pq

    from batchgen_data.jobs.cli import main

    folder, _ = mixtral
    rows = [{"id": i, "prompt": f"Ticket {i}: the parcel arrived {'late' if i % 2 else 'broken'}."} for i in range(8)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = _reference(folder, [{**r, "sampling_params": {"max_tokens": 6, "ignore_eos": True}} for r in rows])
    before = set(_rank_pids())
    seen: set[int] = set()
    thread, box = run_in_thread(lambda: main([
        "run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder), "--max-tokens", "6",
        "--ignore-eos", "--temperature", "0", "--no-progress", "--workers", "2", "--batch-size", "4",
        "--address", cluster.address, "--expert-parallel-size", "2", "--cpus-per-rank", "0.25",
        "--placement-strategy", "SPREAD"]))
    try:
        while thread.is_alive():
            seen |= set(_rank_pids()) - before
            thread.join(0.2)
    finally:
        _reap([p for p in _rank_pids() if p not in before])
    assert box.get("result") == 0, box
    got = [r for p in sorted((tmp_path / "out").glob("part-*")) for r in pq.read_table(p).to_pylist()]
    assert sorted(r["id"] for r in got) == [r["id"] for r in rows]
    assert {r["id"]: list(r["generated_tokens"]) for r in got} == expected
    assert len(seen) >= 2, "the engines ran no rank actors"


def test_removing_a_ranks_node_mid_job_ends_its_group_and_keeps_every_row_once(cluster, mixtral):
    """One engine actor over two ranks on two nodes; one of those nodes goes away mid-job. The
    surviving rank's collective fails, the group ends (no rank left), the actor exits and Ray
    Data restarts it (a new group on the nodes left), and every row comes out exactly once."""
    folder, _ = mixtral
    # Enough tokens that rows are still left when the node goes: with 8-32 tokens a row, a faster
    # decode step finished the whole job first on a loaded machine (no group left to restart).
    rows = [{"id": i, "prompt": f"Row {i}: summarise order {i * 13}.",
             "sampling_params": {"max_tokens": 24 + 72 * (i % 4 == 0), "ignore_eos": True}} for i in range(24)]
    expected = _reference(folder, rows)
    engine_config = {"block_size": 8, "max_num_seqs": 2, "expert_parallel_size": 2, "rank_timeout_s": 30,
                     **ON_TWO_NODES}
    before = set(_rank_pids())
    ds = ray.data.from_items(rows).repartition(6).map_batches(
        BatchGenOperator,
        fn_constructor_kwargs={"model": str(folder), "engine_config": engine_config},
        batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=2),
        num_cpus=0.25,
    )
    thread, box = run_in_thread(ds.take_all)
    try:
        wait_for(lambda: len(operator_pids()) >= 1 and len(set(_rank_pids()) - before) >= 2, 120, "two rank actors")
        time.sleep(3.0)  # rows are running on both ranks
        first_ranks = set(_rank_pids()) - before
        [group] = [g for g in ray.util.placement_group_table().values()
                   if g["state"] == "CREATED" and "ep_slot" in g["bundles"][0]]  # this job's (earlier ones may linger)
        victim = next(node for node in cluster.worker_nodes if node.node_id == group["bundles_to_node_id"][1])
        removed_at = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)
        wait_for(lambda: not any(_alive(p) for p in first_ranks), 30, "the first group's ranks to end")
        torn_down_s = time.monotonic() - removed_at
        # The restarted actor builds a new group on the nodes left (the job has rows to go).
        wait_for(lambda: len(set(_rank_pids()) - before - first_ranks) >= 2 or not thread.is_alive(), 120,
                 "a new rank group")
        restarted = len(set(_rank_pids()) - before - first_ranks) >= 2
        thread.join(240)
        assert not thread.is_alive(), "the job did not finish after the node went away"
        assert "error" not in box, box.get("error")
    finally:
        cluster.add_node(num_cpus=1, resources={"ep_slot": 1})  # capacity back, as an autoscaler would add
        _reap([p for p in _rank_pids() if p not in before])
    print(f"group torn down {torn_down_s:.2f} s after its node was removed")
    assert torn_down_s <= engine_config["rank_timeout_s"]
    assert restarted, "no new rank group started after the failure"
    out = box["result"]
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]  # every row exactly once
    assert all(r["__inference_error__"] is None for r in out)
    assert {r["id"]: list(r["generated_tokens"]) for r in out} == expected
