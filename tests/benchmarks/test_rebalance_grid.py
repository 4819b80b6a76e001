"""The simulated rebalancing grid (``benchmarks/rebalance_grid.py``): seeded scenarios of the
shapes it names, and a small grid that writes its table, JSON and plot; the limit-3 oracle (tail
moves only once every block is handed out) moves nothing while blocks remain."""

from __future__ import annotations

import json
import sys

from benchmarks import rebalance_grid

from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.run import SimConfig, Simulation


def test_scenarios_are_seeded_and_shaped_as_named():
    assert rebalance_grid.scenario_rows("pareto-1.5", 500, 0) == rebalance_grid.scenario_rows("pareto-1.5", 500, 0)
    assert rebalance_grid.scenario_rows("pareto-1.5", 500, 0) != rebalance_grid.scenario_rows("pareto-1.5", 500, 1)
    ascending = [r.output_tokens for r in rebalance_grid.scenario_rows("ascending", 300, 0)]
    assert ascending == sorted(ascending)
    giant = [r.output_tokens for r in rebalance_grid.scenario_rows("giant", 300, 0)]
    assert giant[150] == 4096 and max(giant[:150] + giant[151:]) <= 96


def test_a_small_grid_writes_its_table_json_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rebalance_grid.py", "--rows", "300", "--actors", "2,4", "--only",
                                      "lognormal,giant", "--block-rows", "16", "--max-num-seqs", "16",
                                      "--out", str(tmp_path)])
    rebalance_grid.main()
    report = json.loads((tmp_path / "rebalance-grid.json").read_text())
    assert set(report["results"]) == {"lognormal/2", "lognormal/4", "giant/2", "giant/4"}
    for result in report["results"].values():
        assert result["makespan_s"] >= result["lower_bound_s"] * (1 - 1e-9)
    assert "| giant |" in (tmp_path / "rebalance-grid.md").read_text()
    assert (tmp_path / "rebalance-grid.png").stat().st_size > 1000


def _moves_while_blocks_remain(moves_after_input: bool) -> int:
    rows = rebalance_grid.scenario_rows("pareto-1.1", 1000, 0)
    config = SimConfig(actors=4, max_num_seqs=16, block_rows=16, tasks_in_flight=2, moves_after_input=moves_after_input)
    sim = Simulation(rows, config, ActorModel())
    moved = []
    give_back = sim._give_back

    def watched(i, moves):
        before = sim.moves
        give_back(i, moves)
        if sim.blocks and sim.moves > before:
            moved.append(sim.moves - before)

    sim._give_back = watched
    sim.run()
    assert sim.rows_left == 0
    return sum(moved)


def test_the_oracle_moves_nothing_while_blocks_remain():
    assert _moves_while_blocks_remain(False) > 0  # this scenario moves rows while blocks still come ...
    assert _moves_while_blocks_remain(True) == 0  # ... and the oracle does not
