"""The rebalancing simulator (``rebalance/simulate``): exact on cases worked by hand, every row done
once on generated scenarios, never below the lower bound, deterministic for a seed, and a command
that answers bad input with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.rebalance.simulate.bounds import lower_bound_s
from batchgen_data.rebalance.simulate.cli import run_scenario
from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.run import SimConfig, simulate
from batchgen_data.rebalance.simulate.scenario import Row, write_scenario

_MODEL = ActorModel(base_s=0.01, per_seq_s=0.002, prefill_s_per_token=0.0001, startup_s=1.0)


def test_one_actor_of_equal_rows_takes_what_the_step_model_says():
    rows = [Row(0, 10, 10) for _ in range(4)]
    for rebalance in (False, True):
        result = simulate(rows, SimConfig(actors=1, max_num_seqs=4, rebalance=rebalance), _MODEL)
        assert abs(result.makespan_s - (1.0 + 10 * (0.01 + 0.002 * 4))) < 1e-9, rebalance
        assert result.moves == 0


def test_rows_that_queue_run_in_rounds_on_one_actor():
    # 4 rows of 10 tokens, 2 slots: two rounds of 10 steps at 2 running; the prompts' prefill is
    # paid in the step that admits them.
    rows = [Row(100, 10, 10) for _ in range(4)]
    result = simulate(rows, SimConfig(actors=1, max_num_seqs=2, rebalance=False), _MODEL)
    assert abs(result.makespan_s - (1.0 + 20 * 0.014 + 4 * 100 * 0.0001)) < 1e-9


def test_blocks_go_to_the_least_busy_actor_as_ray_datas_actor_pool_hands_them_out():
    # 8 blocks of 4 rows, 4 actors holding up to 4 calls each: Ray Data's pool (pick_actor) gives
    # each actor 2 blocks, one round of 8 rows each. Filling one actor's calls before the next
    # would give two actors 16 rows each, two rounds.
    rows = [Row(0, 10, 10) for _ in range(32)]
    result = simulate(rows, SimConfig(actors=4, max_num_seqs=8, block_rows=4, tasks_in_flight=4, rebalance=False),
                      _MODEL)
    assert abs(result.makespan_s - (1.0 + 10 * (0.01 + 0.002 * 8))) < 1e-9
    assert result.idle_share < 1e-9


def test_a_block_beyond_the_actors_concurrent_calls_waits_at_the_actor_until_a_call_ends():
    # One actor, two blocks of 4 rows (10 and 20 tokens), 8 slots. Ray 2.60 hands it both blocks
    # (2 tasks in flight); with one concurrent call the second block's call starts only when the
    # first's last row ends: 10 steps at 4 running, then 20 at 4. With two calls, both run
    # together: 10 steps at 8 running, then 10 at 4.
    rows = [Row(0, 10, 10) for _ in range(4)] + [Row(0, 20, 20) for _ in range(4)]
    config = SimConfig(actors=1, max_num_seqs=8, block_rows=4, tasks_in_flight=2, rebalance=False)
    one_call = simulate(rows, replace(config, concurrent_calls=1), _MODEL)
    assert abs(one_call.makespan_s - (1.0 + 30 * (0.01 + 0.002 * 4))) < 1e-9
    two_calls = simulate(rows, replace(config, concurrent_calls=2), _MODEL)
    assert abs(two_calls.makespan_s - (1.0 + 10 * (0.01 + 0.002 * 8) + 10 * (0.01 + 0.002 * 4))) < 1e-9
    assert simulate(rows, config, _MODEL).makespan_s == two_calls.makespan_s  # None: as many as in flight


def test_a_long_row_stuck_behind_a_full_engine_moves_to_an_idle_actor():
    # Actor 0 gets the only block: 8 rows, 2 slots, a long row last. Without rebalancing it waits
    # for three rounds; with the pool, actor 1 (no block of its own) takes the queued rows.
    rows = [Row(16, 64, 64) for _ in range(7)] + [Row(16, 400, 400)]
    config = SimConfig(actors=2, max_num_seqs=2, block_rows=8, tasks_in_flight=1)
    on, off = simulate(rows, config, _MODEL), simulate(rows, replace(config, rebalance=False), _MODEL)
    assert on.rows_in_pool > 0
    assert on.makespan_s < 0.8 * off.makespan_s, (on, off)


def test_long_rows_run_before_the_pool_started_move_to_an_idle_actor():
    # Ray Data hands the blocks out least busy first. Actor 0's first block (8 long rows) fits
    # its 8 slots and starts outside the pool, as does actor 1's (short rows); actor 0's second
    # would queue, so it starts the pool, and actor 1's second goes there too. Actor 1 is then
    # idle: the long rows, adopted into the pool as they move, split over both actors.
    rows = [Row(16, 300, 300) for _ in range(8)] + [Row(16, 8, 8) for _ in range(24)]
    config = SimConfig(actors=2, max_num_seqs=8, block_rows=8, tasks_in_flight=2)
    on, off = simulate(rows, config, _MODEL), simulate(rows, replace(config, rebalance=False), _MODEL)
    assert on.moves > 0 and on.rows_in_pool == 16
    # Off: ~300 steps at 8 running (26 ms each); on: about half the rows move early, both actors
    # then run ~4 (18 ms).
    assert on.makespan_s < 0.85 * off.makespan_s, (on, off)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    rows = [Row(32, 16 + (i * 37) % 200, 256) for i in range(300)]
    config = SimConfig(actors=4, max_num_seqs=16, block_rows=16, jitter=0.2, seed=7)
    a, b = run_scenario(rows, config, _MODEL), run_scenario(rows, config, _MODEL)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    c = run_scenario(rows, replace(config, seed=8), _MODEL)
    assert c["makespan_s"] != a["makespan_s"]


@settings(max_examples=60, deadline=None)
@given(outputs=st.lists(st.integers(1, 300), min_size=1, max_size=60), prompts=st.integers(0, 200),
       actors=st.integers(1, 6), max_num_seqs=st.integers(1, 8), block_rows=st.integers(1, 16),
       tasks=st.integers(1, 4), calls=st.one_of(st.none(), st.integers(1, 2)), budget=st.integers(0, 64))
def test_generated_scenarios_finish_every_row_once_and_never_beat_the_lower_bound(
        outputs, prompts, actors, max_num_seqs, block_rows, tasks, calls, budget):
    rows = [Row(prompts, n, n + budget) for n in outputs]
    bound = lower_bound_s(rows, actors, max_num_seqs, _MODEL)
    for rebalance in (False, True):
        # ``run`` raises if a row is left undone or a pool item outstanding; steps count tokens
        result = simulate(rows, SimConfig(actors, max_num_seqs, block_rows, tasks, rebalance, concurrent_calls=calls),
                          _MODEL)
        assert result.makespan_s >= bound - 1e-9, (rebalance, result.makespan_s, bound)


def test_the_command_prints_one_json_object_and_refuses_bad_rows_in_one_line(tmp_path):
    path = tmp_path / "scenario.jsonl"
    write_scenario(path, [Row(32, 8 + i % 50, 64) for i in range(200)])
    cmd = [sys.executable, "-m", "batchgen_data.rebalance.simulate", str(path), "--actors", "4", "--max-num-seqs", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("makespan_s", "lower_bound_s", "no_rebalance_s", "moves", "moved_tokens", "idle_share"):
        assert key in report, key
    assert report["lower_bound_s"] <= min(report["makespan_s"], report["no_rebalance_s"])
    path.write_text('{"prompt_tokens": 3, "output_tokens": 0}\n')
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "output_tokens must be an int >= 1" in bad.stderr, bad.stderr
