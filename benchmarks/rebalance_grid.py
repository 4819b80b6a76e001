"""Rebalancing at scale, by simulation: makespan against the lower bound on a grid of skewed
workloads and actor counts, with rebalancing and without (issue #52).

    .venv/bin/python benchmarks/rebalance_grid.py                       # the grid (AMD EPYC: ~N min)
    .venv/bin/python benchmarks/rebalance_grid.py --rows 2000 --actors 8,32 --only lognormal,giant
    .venv/bin/python benchmarks/rebalance_grid.py --step-model step.json  # another engine's step model
    .venv/bin/python benchmarks/rebalance_grid.py --actors 2,8 --moves-after-input  # the oracle of limit 3

Each scenario is written as a JSONL scenario file and run through the simulator
(``python -m batchgen_data.rebalance.simulate``'s ``run_scenario``: the real ``rebalance/core``
policy over modelled actors). Writes ``rebalance-grid.json``, ``rebalance-grid.md`` (the table)
and ``rebalance-grid.png`` (makespan / lower bound per scenario and actor count, on and off)
under ``--out`` (default ``docs/results``).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from batchgen_data.hardware import cpu_model
from batchgen_data.rebalance.simulate.cli import run_scenario
from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.run import SimConfig
from batchgen_data.rebalance.simulate.scenario import Row, read_scenario, write_scenario

_MAX_OUTPUT = 4096


def _clip(n: float) -> int:
    return max(1, min(_MAX_OUTPUT, int(n)))


def _lognormal(rng: random.Random, n: int) -> list[int]:
    return [_clip(rng.lognormvariate(4.5, 1.0)) for _ in range(n)]


def _pareto(alpha: float):
    return lambda rng, n: [_clip(16 * rng.paretovariate(alpha)) for _ in range(n)]


def _bimodal(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(512, 1024) if rng.random() < 0.1 else rng.randint(16, 64) for _ in range(n)]


def _clustered(rng: random.Random, n: int) -> list[int]:
    """Bimodal, the long rows together in the first blocks (one block's rows queue on one actor)."""
    lengths = _bimodal(rng, n)
    return sorted(lengths[: n // 5], reverse=True) + lengths[n // 5:]


def _giant(rng: random.Random, n: int) -> list[int]:
    lengths = [rng.randint(32, 96) for _ in range(n)]
    lengths[n // 2] = _MAX_OUTPUT
    return lengths


SCENARIOS = {
    "lognormal": _lognormal,
    "pareto-1.1": _pareto(1.1),
    "pareto-1.5": _pareto(1.5),
    "pareto-2": _pareto(2.0),
    "bimodal": _bimodal,
    "clustered": _clustered,
    "ascending": lambda rng, n: sorted(_lognormal(rng, n)),
    "descending": lambda rng, n: sorted(_lognormal(rng, n), reverse=True),
    "giant": _giant,
    "equal": lambda rng, n: [128] * n,
}


def scenario_rows(name: str, num_rows: int, seed: int) -> list[Row]:
    rng = random.Random(f"{name}-{seed}")
    return [Row(rng.randint(32, 256), out, out) for out in SCENARIOS[name](rng, num_rows)]


def render(report: dict) -> str:
    lines = [(f"Simulated ({report['rows']} rows a scenario, {report['model_name']}; CPU {report['cpu']}). "
              "Makespan over the lower bound, with rebalancing / without; moves; idle share with rebalancing."), "",
             "| scenario | " + " | ".join(f"{a} actors" for a in report["actors"]) + " |",
             "|---|" + "---:|" * len(report["actors"])]
    for name in report["scenarios"]:
        cells = []
        for a in report["actors"]:
            r = report["results"][f"{name}/{a}"]
            off = r["no_rebalance_s"] / r["lower_bound_s"]
            cells.append(f"{r['makespan_over_bound']:.2f} / {off:.2f} ({r['moves']} moves, idle {r['idle_share']:.0%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, actors = report["scenarios"], report["actors"]
    fig, axes = plt.subplots(1, len(actors), figsize=(4 * len(actors), 4), sharey=True)
    for ax, a in zip(axes if len(actors) > 1 else [axes], actors):
        on = [report["results"][f"{n}/{a}"]["makespan_over_bound"] for n in names]
        off = [report["results"][f"{n}/{a}"]["no_rebalance_s"] / report["results"][f"{n}/{a}"]["lower_bound_s"]
               for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], off, width=0.4, label="no rebalancing", color="#bbbbbb")
        ax.bar([x + 0.2 for x in xs], on, width=0.4, label="rebalancing", color="#3070b0")
        ax.axhline(1.15, color="#c03030", linewidth=1, linestyle="--", label="1.15 x lower bound")
        ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{a} actors")
    axes_list = axes if len(actors) > 1 else [axes]
    axes_list[0].set_ylabel("makespan / lower bound")
    axes_list[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--actors", default="2,8,32,128")
    parser.add_argument("--only", default=None, help="comma-separated scenario names")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-rows", type=int, default=64)
    parser.add_argument("--tasks-in-flight", type=int, default=4, help="blocks Ray Data hands an actor at once "
                        "(max_tasks_in_flight_per_actor; Ray 2.60: 2x --concurrent-calls)")
    parser.add_argument("--concurrent-calls", type=int, default=None,
                        help="calls an actor runs at once (max_concurrent_batches; the processor's default is 8); "
                             "default: --tasks-in-flight")
    parser.add_argument("--step-model", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moves-after-input", action="store_true",
                        help="an oracle: tail moves only once every block is handed out (SimConfig.moves_after_input)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    actors = [int(a) for a in args.actors.split(",")]
    model = ActorModel.from_file(args.step_model) if args.step_model else ActorModel()
    report = {"cpu": cpu_model(), "rows": args.rows, "actors": actors, "scenarios": names,
              "model_name": str(args.step_model or "the demo model's default step model"), "model": model.to_dict(),
              "max_num_seqs": args.max_num_seqs, "block_rows": args.block_rows,
              "tasks_in_flight": args.tasks_in_flight, "concurrent_calls": args.concurrent_calls, "seed": args.seed,
              "moves_after_input": args.moves_after_input, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = Path(tmp) / f"{name}.jsonl"
            write_scenario(path, scenario_rows(name, args.rows, args.seed))
            rows = read_scenario(path)  # what the command line would read
            for a in actors:
                config = SimConfig(a, args.max_num_seqs, args.block_rows, args.tasks_in_flight, True, args.seed,
                                   moves_after_input=args.moves_after_input, concurrent_calls=args.concurrent_calls)
                result = run_scenario(rows, config, model)
                report["results"][f"{name}/{a}"] = result
                print(f"{name:12s} {a:4d} actors: {result['makespan_over_bound']:.3f}x bound "
                      f"(off {result['no_rebalance_s'] / result['lower_bound_s']:.3f}x), {result['moves']} moves, "
                      f"{result['wall_s']} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rebalance-grid.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "rebalance-grid.md").write_text(render(report))
    plot(report, args.out / "rebalance-grid.png")
    print(render(report))


if __name__ == "__main__":
    main()
