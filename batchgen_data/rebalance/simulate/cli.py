"""``python -m batchgen_data.rebalance.simulate SCENARIO.jsonl --actors N``: one stage, simulated
with rebalancing and without, over the same rows; the last line of stdout is one JSON object
(``makespan_s``, ``lower_bound_s``, ``no_rebalance_s``, ``moves``, ``moved_tokens``,
``idle_share``, and what produced them)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from batchgen_data.errors import ConfigError
from batchgen_data.rebalance.simulate.bounds import lower_bound_s
from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.run import SimConfig, simulate
from batchgen_data.rebalance.simulate.scenario import Row, read_scenario

_DEFAULTS = {f.name: f.default for f in fields(SimConfig)}


def run_scenario(rows: list[Row], config: SimConfig, model: ActorModel) -> dict:
    """Both runs of a scenario (with the pool unless ``config.rebalance`` is off, and without),
    and the lower bound, as the command reports them."""
    started = time.perf_counter()
    off = simulate(rows, replace(config, rebalance=False), model)
    on = simulate(rows, config, model) if config.rebalance else off
    bound = lower_bound_s(rows, config.actors, config.max_num_seqs, model)
    return {
        "makespan_s": round(on.makespan_s, 4), "lower_bound_s": round(bound, 4),
        "no_rebalance_s": round(off.makespan_s, 4), "moves": on.moves, "moved_tokens": on.moved_tokens,
        "idle_share": round(on.idle_share, 4), "no_rebalance_idle_share": round(off.idle_share, 4),
        "makespan_over_bound": round(on.makespan_s / bound, 4), "rows": len(rows), "rows_in_pool": on.rows_in_pool,
        "lease_calls": on.lease_calls, "steps": on.steps, "config": asdict(config), "model": model.to_dict(),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgen_data.rebalance.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", type=Path, help="JSONL: one row per line, {prompt_tokens, output_tokens}")
    parser.add_argument("--actors", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"])
    parser.add_argument("--block-rows", type=int, default=_DEFAULTS["block_rows"], help="rows per block (batch_size)")
    parser.add_argument("--tasks-in-flight", type=int, default=_DEFAULTS["tasks_in_flight"],
                        help="blocks an actor holds at once (max_tasks_in_flight_per_actor)")
    parser.add_argument("--concurrent-calls", type=int, default=None,
                        help="calls an actor runs at once (max_concurrent_batches); default: --tasks-in-flight")
    parser.add_argument("--step-model", type=Path, default=None,
                        help="JSON with ActorModel's fields (benchmarks/skew.py writes one); default: the demo model on CPU")
    parser.add_argument("--no-rebalance", action="store_true", help="only the run without the pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter", type=float, default=0.0, help="relative noise on each step's time (seeded)")
    args = parser.parse_args(argv)
    try:
        model = ActorModel.from_file(args.step_model) if args.step_model else ActorModel()
        rows = read_scenario(args.scenario)
        config = SimConfig(args.actors, args.max_num_seqs, args.block_rows, args.tasks_in_flight,
                           not args.no_rebalance, args.seed, args.jitter, concurrent_calls=args.concurrent_calls)
        report = run_scenario(rows, config, model)
    except (ConfigError, ValueError, OSError) as err:
        print(f"batchgen-data simulate: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
