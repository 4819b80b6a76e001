"""Skew benchmark: does cross-actor rebalancing pay where it can, and cost nothing where it can't,
on a grid of skewed workloads rather than one configuration?

    .venv/bin/python benchmarks/skew.py            # the seeded grid, 5 off/on pairs each (~1-2 h on 2 CPUs)
    .venv/bin/python benchmarks/skew.py --quick    # 2 scenarios x 2 pairs: a smoke test (~5 min)
    .venv/bin/python benchmarks/skew.py --list     # print the grid and exit
    .venv/bin/python benchmarks/skew.py --aa --only g05-in-set  # the noise floor: pairs of two runs without rebalancing
    .venv/bin/python benchmarks/skew.py --only issue-queued,issue-in-set --pairs 3 --expert-parallel-size 2
                                                   # replicas of 2 Ray-placed expert-parallel ranks each

``BatchGenOperator`` actors on the demo model (``ActorPoolStrategy(size=actors,
max_concurrent_calls_per_actor=2, max_tasks_in_flight_per_actor=2)``, 0.5 CPU each). A scenario
(``Scenario``) sets the rows (48-512), the block size (= ``batch_size``), the share of long rows
and where they sit (front, middle, spread evenly, shuffled), the long and short lengths
(``ignore_eos``), ``max_num_seqs`` (8 to the engine's default) and the actor count (2 or 3). The
grid (``grid``) is a few fixed anchors (the issue's workloads and the earlier single-configuration
benchmark) plus scenarios drawn with ``--seed``. Each scenario runs as ``--pairs`` off/on pairs
(no rebalancing, rebalancing), the order alternating pair by pair, all in one Ray cluster after an
untimed warm-up; the coordinator is killed after every run, so each rebalanced run starts its own
as a job would: on demand, when an actor's rows would queue (inside the timed wall; a run where
none would runs without one).

Per scenario it reports the median and min over pairs of the wall ratio (off / on, the whole
``map_batches`` job with actor start-up) and of the span ratio (first to last engine step over
all actors: start-up noise left out), the rebalanced span against the best possible (the work
divided evenly: ``ideal_steps`` at the run's median step time), the wall ratio that even division
would have given in the same pair (the rebalanced wall with its span replaced by the ideal one:
the ceiling start-up leaves), and where the time went per actor in the worst pair. Classes and targets (``TARGETS``): ``in-set`` (the long rows fit one running
set) and ``shuffled`` must not lose (median >= 0.98, every pair >= 0.95); ``queued`` (the long rows
of one block queue behind one actor's running set) must gain (median >= 1.4, every pair >= 1.25,
span within 10% of the ideal); ``mixed`` is reported without a target. Writes ``skew.json`` and
``skew.md`` (the table, with the command and the CPU) under ``--out``; ``--from-json FILE`` renders
them again from a ``skew.json`` without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import BatchGenOperator  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402

# A gap between two engine steps longer than this counts as idle time on the timeline.
_IDLE_GAP_S = 0.2
# The engine's default running set (``EngineConfig.max_num_seqs``), for scenarios that keep it.
_DEFAULT_MAX_NUM_SEQS = 256
# Calls in flight per actor, and tasks Ray Data may queue at it (no batch waits behind a busy one).
_CONCURRENCY = 2
# A drawn scenario whose run without rebalancing would take longer than this (estimated at
# ``_STEP_S_ESTIMATE`` per step) is drawn again: the grid must fit an afternoon on 2 CPUs.
_MAX_STEPS = 1400
_STEP_S_ESTIMATE = 0.03

TARGETS = {  # class -> (median at least, every pair at least, rebalanced span over the ideal at most)
    "in-set": (0.98, 0.95, None),
    "shuffled": (0.98, 0.95, None),
    "queued": (1.4, 1.25, 1.10),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    rows: int
    block_size: int
    num_long: int
    position: str  # "front", "middle", "spread" or "shuffled"
    long_tokens: int
    short_tokens: int
    max_num_seqs: int | None  # None: the engine's default
    actors: int

    @property
    def running_set(self) -> int:
        return self.max_num_seqs or _DEFAULT_MAX_NUM_SEQS

    def long_indices(self, seed: int) -> list[int]:
        n, k = self.rows, self.num_long
        if self.position == "front":
            return list(range(k))
        if self.position == "middle":
            return list(range((n - k) // 2, (n - k) // 2 + k))
        if self.position == "spread":
            return [round(i * n / k) for i in range(k)]
        return sorted(random.Random(seed).sample(range(n), k))

    @property
    def kind(self) -> str:
        """The class its target comes from (module docstring): ``queued`` where every long row
        sits in one block (so without rebalancing one actor gets them all, however Ray Data
        dispatches) and they outnumber its running set."""
        if self.position == "shuffled":
            return "shuffled"
        if self.num_long <= self.running_set:
            return "in-set"
        blocks = {i // self.block_size for i in self.long_indices(0)}
        return "queued" if len(blocks) == 1 else "mixed"

    def ideal_steps(self) -> int:
        """Steps with the work divided evenly over every actor's running slots (a lower bound:
        no row runs faster than one token a step)."""
        tokens = self.num_long * self.long_tokens + (self.rows - self.num_long) * self.short_tokens
        return max(self.long_tokens, math.ceil(tokens / (self.actors * self.running_set)))

    def steps_without_rebalancing(self) -> int:
        """A rough upper bound: every long row on one actor, in waves of its running set."""
        waves = math.ceil(self.num_long / self.running_set)
        return waves * self.long_tokens + self.short_tokens * math.ceil(self.rows / self.running_set)


def make_rows(scenario: Scenario, seed: int) -> list[dict]:
    rng = random.Random(seed)
    long_rows = set(scenario.long_indices(seed))
    return [{"id": i, "prompt": f"Order {i}: the parcel {rng.randrange(10**6)} arrived damaged, please advise.",
             "sampling_params": {"max_tokens": scenario.long_tokens if i in long_rows else scenario.short_tokens,
                                 "ignore_eos": True}}
            for i in range(scenario.rows)]


ANCHORS = (
    # The workloads (#33): 2 actors, the default running set, 8 long rows at the front.
    Scenario("issue-in-set", 96, 16, 8, "front", 256, 8, None, 2),
    Scenario("issue-queued", 96, 16, 16, "front", 256, 8, 8, 2),
    # The earlier single-configuration benchmark (128 rows, blocks of 32, max_num_seqs 8).
    Scenario("v1-in-set", 128, 32, 4, "front", 256, 8, 8, 2),
    Scenario("v1-queued", 128, 32, 32, "front", 256, 8, 8, 2),
    Scenario("v1-shuffled", 128, 32, 32, "shuffled", 256, 8, 8, 2),
)
DIMENSIONS = {
    "rows": (48, 96, 128, 256, 512),
    "block_size": (8, 16, 32, 64),
    "long_share": (1 / 16, 1 / 8, 1 / 4),
    "position": ("front", "middle", "spread", "shuffled"),
    "long_tokens": (128, 256),
    "short_tokens": (8, 16),
    "max_num_seqs": (8, 16, 32, None),
    "actors": (2, 3),
}


def grid(seed: int, num_drawn: int) -> list[Scenario]:
    """The anchors, then ``num_drawn`` scenarios drawn with ``seed`` from ``DIMENSIONS``, their
    classes in turn (queued, in-set, shuffled, mixed: each class comes up), a draw of another
    class or one that would run too long drawn again. Blocks are of a size listed that still
    makes three blocks at least."""
    rng = random.Random(seed)
    kinds = ("queued", "in-set", "shuffled", "mixed")
    scenarios = list(ANCHORS)
    for i in range(num_drawn):
        kind = kinds[i % len(kinds)]
        while True:
            pick = {dim: rng.choice(values) for dim, values in DIMENSIONS.items()}
            if (pick["position"] == "shuffled") != (kind == "shuffled"):
                continue
            block = rng.choice([b for b in DIMENSIONS["block_size"] if b <= max(8, pick["rows"] // 3)])
            num_long = max(1, round(pick["rows"] * pick["long_share"]))
            scenario = Scenario(f"g{i:02d}-{kind}", pick["rows"], block, num_long, pick["position"],
                                pick["long_tokens"], pick["short_tokens"], pick["max_num_seqs"], pick["actors"])
            if scenario.kind == kind and scenario.steps_without_rebalancing() <= _MAX_STEPS:
                break
        scenarios.append(scenario)
    return scenarios


QUICK = (Scenario("quick-in-set", 48, 16, 4, "front", 128, 8, None, 2),
         Scenario("quick-queued", 48, 16, 16, "front", 128, 8, 8, 2))


def warm_up(ray, scenarios: list[Scenario], expert_parallel_size: int = 1) -> None:
    """Small untimed jobs first, so no timed case pays the cold start alone (worker processes,
    imports from a cold page cache, the demo checkpoint, the engine's GEMM plan, and the step
    model's calibration, which a machine keeps per model and running-set cap: one rebalanced job
    per cap the scenarios use)."""
    actors = max(s.actors for s in scenarios)
    rows = make_rows(Scenario("warm-up", 4 * actors, 4, 0, "front", 4, 4, None, actors), 0)
    for max_num_seqs in sorted({s.max_num_seqs or _DEFAULT_MAX_NUM_SEQS for s in scenarios}):
        engine_config, actor_cpus = engine_setup(max_num_seqs, expert_parallel_size, actors)
        ray.data.from_items(rows, override_num_blocks=actors).map_batches(
            BatchGenOperator, fn_constructor_kwargs={"model": "demo", "engine_config": engine_config,
                                                     "rebalance": True},
            batch_size=4, compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=actor_cpus,
        ).take_all()
        _kill_coordinators(ray)


def engine_setup(max_num_seqs: int | None, expert_parallel_size: int, actors: int) -> tuple[dict, float]:
    """The engine config and the actor's CPUs. With N > 1 expert-parallel ranks per engine, the
    ranks are Ray actors that divide the machine's CPUs evenly among all the replicas' ranks
    (the engine actors, which only steer them, take none), so a replica's ranks bind to its share
    of the cores (two ranks of 0.5 CPU share one core) as replicas on separate machines would own
    theirs; the engine's running set stays the scenario's, split over its ranks."""
    config = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    if expert_parallel_size == 1:
        return config, 0.5
    if max_num_seqs is not None:
        config["max_num_seqs"] = -(-max_num_seqs // expert_parallel_size)
    share = int(100 * (os.cpu_count() or 1) / (actors * expert_parallel_size)) / 100
    return {**config, "expert_parallel_size": expert_parallel_size, "rank_resources": {"CPU": share}}, 0


def run_case(ray, scenario: Scenario, rows: list[dict], rebalance: bool, stats_dir: Path,
             expert_parallel_size: int = 1) -> dict:
    shutil.rmtree(stats_dir, ignore_errors=True)
    stats_dir.mkdir(parents=True)
    engine_config, actor_cpus = engine_setup(scenario.max_num_seqs, expert_parallel_size, scenario.actors)
    # Blocks made in the driver: a repartition would need a whole CPU for its tasks, which three
    # half-CPU actors on 2 CPUs leave no room for (the job then hangs with no error).
    ds = ray.data.from_items(rows, override_num_blocks=math.ceil(scenario.rows / scenario.block_size))
    kwargs = {"model": "demo", "engine_config": engine_config, "rebalance": rebalance, "stats_dir": str(stats_dir),
              "max_concurrent_batches": _CONCURRENCY}  # as the simulator's actors report their call slots
    start = time.time()
    out = ds.map_batches(
        BatchGenOperator,
        fn_constructor_kwargs=kwargs,
        batch_size=scenario.block_size,
        compute=ray.data.ActorPoolStrategy(size=scenario.actors, max_concurrent_calls_per_actor=_CONCURRENCY,
                                           max_tasks_in_flight_per_actor=_CONCURRENCY),
        num_cpus=actor_cpus,
    ).take_all()
    wall = time.time() - start
    if rebalance:
        _kill_coordinators(ray)
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows], "rows lost or duplicated"
    actors = [where_time_went(json.loads(p.read_text()), start, wall) for p in sorted(stats_dir.glob("actor-*.json"))]
    steps = [a for a in actors if a["num_steps"]]
    span = max(a["last_step_s"] for a in steps) - min(a["first_step_s"] for a in steps)
    step_times = sorted(s for a in steps for s in a["step_times"])
    for a in actors:
        del a["step_times"]
    return {"rebalance": rebalance, "wall_s": wall, "span_s": span, "median_step_s": statistics.median(step_times),
            "actors": actors}


def predicted(scenario: Scenario, rows: list[dict], pair: dict) -> dict:
    """The pair's two runs as the simulator predicts them (``python -m
    batchgen_data.rebalance.simulate``: the real pool policy over modelled actors): the step
    model the rebalanced run's actors calibrated at start-up (their mean line), start-up as the
    actors measured it in each run (engine start to first step), the scenario's blocks, running
    set and calls in flight. ``level`` is the same with the line scaled to the run's median
    step (the other actor on the same cores slows every step: the level the job ran at)."""
    from batchgen_data.rebalance.simulate.model import ActorModel
    from batchgen_data.rebalance.simulate.run import SimConfig, simulate
    from batchgen_data.rebalance.simulate.scenario import Row

    cal = [a for a in pair["on"]["actors"] if a["calibrated_base_s"] + a["calibrated_per_seq_s"] > 0]
    if not cal:
        return {}
    base = statistics.fmean(a["calibrated_base_s"] for a in cal)
    per_seq = statistics.fmean(a["calibrated_per_seq_s"] for a in cal)
    sim_rows = [Row(len(r["prompt"]) // 4 + 1, r["sampling_params"]["max_tokens"], r["sampling_params"]["max_tokens"])
                for r in rows]
    out = {"calibrated_base_s": base, "calibrated_per_seq_s": per_seq}
    for side in ("off", "on"):
        run = pair[side]
        startup = statistics.fmean(a["first_step_s"] for a in run["actors"] if a["first_step_s"] is not None)
        config = SimConfig(scenario.actors, scenario.running_set, scenario.block_size, _CONCURRENCY, side == "on")
        model = ActorModel(base_s=base, per_seq_s=per_seq, startup_s=startup)
        out[f"{side}_s"] = simulate(sim_rows, config, model).makespan_s
        # the level: the calibrated line scaled to this run's median step at its mean running set
        running = [n for a in run["actors"] for _, n, _ in a["timeline"]]
        expected = base + per_seq * statistics.fmean(running) if running else 0.0
        factor = run["median_step_s"] / expected if expected > 0 else 1.0
        leveled = ActorModel(base_s=base * factor, per_seq_s=per_seq * factor, startup_s=startup)
        out[f"{side}_level_s"] = simulate(sim_rows, config, leveled).makespan_s
        out[f"{side}_measured_s"] = run["wall_s"]
    return out


def _kill_coordinators(ray) -> None:
    """End the stage's coordinator: the next rebalanced run starts its own, as a new job would."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("batchgen-pool-"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


def where_time_went(report: dict, job_start: float, wall: float) -> dict:
    """One actor's run: engine steps, idle gaps, work-pool calls, moves, start-up."""
    steps = report["timeline"]
    at = [report["start_wall"] + s["t"] - job_start for s in steps]  # each step's end, job time
    busy = sum(s["step_s"] for s in steps)
    gaps = [(a - s["step_s"]) - b for a, b, s in zip(at[1:], at, steps[1:])]
    reb = report["rebalance"] or {}
    since = {key: (reb[key] - job_start if reb.get(key) else None)
             for key in ("ready_wall", "first_call_wall", "first_items_wall", "joined_pool_wall")}
    return {
        "pid": report["pid"], "num_steps": len(steps), "busy_s": busy,
        "engine_start_s": report["start_wall"] - job_start, **since,
        "first_step_s": at[0] - steps[0]["step_s"] if steps else None, "last_step_s": at[-1] if steps else None,
        "idle_gap_s": sum(g for g in gaps if g > _IDLE_GAP_S), "idle_fraction": max(0.0, 1 - busy / wall),
        "calibration_s": reb.get("calibration_s", 0.0), "calibration_cached": reb.get("calibration_cached", False),
        "calibrated_base_s": reb.get("calibrated_base_s", 0.0), "calibrated_per_seq_s": reb.get("calibrated_per_seq_s", 0.0),
        "pool_calls": reb.get("num_pool_calls", 0), "pool_call_s": reb.get("pool_call_s", 0.0),
        "pool_held_s": reb.get("pool_held_s", 0.0), "leased": reb.get("num_leased", 0),
        "local_batches": reb.get("num_local_batches", 0),
        "given_back": reb.get("num_given_back", 0), "continued": reb.get("num_continued", 0),
        "moved_kv_bytes": reb.get("migrated_out_bytes", 0), "recomputed_tokens": reb.get("num_recomputed_tokens", 0),
        "moves": [(t - job_start, what, s, n, b) for t, what, s, n, b in reb.get("events", [])],
        "timeline": [(t, s["num_running"], s["num_waiting"]) for t, s in zip(at, steps)],
        "step_times": [s["step_s"] for s in steps],
    }


def summarize(scenario: Scenario, pairs: list[dict]) -> dict:
    """The scenario's ratios over its pairs, the target check, and the worst pair's index."""
    wall = [p["off"]["wall_s"] / p["on"]["wall_s"] for p in pairs]
    span = [p["off"]["span_s"] / p["on"]["span_s"] for p in pairs]
    ideal = [p["on"]["span_s"] / (scenario.ideal_steps() * p["on"]["median_step_s"]) for p in pairs]
    # The wall ratio an even split would have given in the same pair: the rebalanced run's wall
    # with its span replaced by the ideal one (start-up, which no split shortens, kept).
    even = [p["off"]["wall_s"] / (p["on"]["wall_s"] - p["on"]["span_s"] + scenario.ideal_steps() * p["on"]["median_step_s"])
            for p in pairs]
    summary = {"kind": scenario.kind, "wall": wall, "span": span, "on_span_over_ideal": ideal,
               "wall_at_even_split": even, "wall_at_even_split_median": statistics.median(even),
               "wall_median": statistics.median(wall), "wall_min": min(wall),
               "span_median": statistics.median(span), "span_min": min(span),
               "ideal_median": statistics.median(ideal), "worst_pair": wall.index(min(wall))}
    target = TARGETS.get(scenario.kind)
    if target is not None:
        median_at_least, each_at_least, ideal_at_most = target
        met = summary["wall_median"] >= median_at_least and summary["wall_min"] >= each_at_least
        if ideal_at_most is not None:
            met = met and summary["ideal_median"] <= ideal_at_most
        summary["target"] = f"median >= {median_at_least}, min >= {each_at_least}" + (
            f", span <= {ideal_at_most} x ideal" if ideal_at_most else "")
        summary["met"] = met
    return summary


def table(results: list[dict], command: str, cpu: str | None = None) -> str:
    """The grid's table (markdown), with the command and the machine."""
    lines = [f"`{command}` on {cpu or cpu_model()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}", "",
             "| scenario | class | rows / block | long (pos, tokens) | short | max_num_seqs | actors | pairs "
             "| wall off/on median (min) | span off/on median (min) | on span / ideal | wall at even split | target |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        s, m = Scenario(**r["scenario"]), r["summary"]
        verdict = "-" if "met" not in m else ("met" if m["met"] else "MISSED")
        lines.append(f"| {s.name} | {m['kind']} | {s.rows} / {s.block_size} | {s.num_long} ({s.position}, "
                     f"{s.long_tokens}) | {s.short_tokens} | {s.max_num_seqs or 'default'} | {s.actors} "
                     f"| {len(r['pairs'])} | {m['wall_median']:.2f}x ({m['wall_min']:.2f}x) "
                     f"| {m['span_median']:.2f}x ({m['span_min']:.2f}x) | {m['ideal_median']:.2f} "
                     f"| {m['wall_at_even_split_median']:.2f}x | {verdict} |")
    return "\n".join(lines)


def worst_pair_lines(result: dict) -> list[str]:
    """Where the time went, per actor, in a scenario's worst pair (by wall ratio)."""
    summary = result["summary"]
    pair = result["pairs"][summary["worst_pair"]]
    lines = [f"{result['scenario']['name']}: worst pair {summary['worst_pair']} "
             f"(off {pair['off']['wall_s']:.1f} s, on {pair['on']['wall_s']:.1f} s)"]
    for side in ("off", "on"):
        for i, a in enumerate(pair[side]["actors"]):
            line = (f"  {side:>3} actor {i}: engine {a['engine_start_s']:.1f} s, first step {_s(a['first_step_s'])}, "
                    f"last {_s(a['last_step_s'])}, {a['num_steps']} steps ({a['busy_s']:.1f} s busy), "
                    f"gaps {a['idle_gap_s']:.1f} s")
            if side == "on":
                line += (f"; ready {_s(a['ready_wall'])} (calibration {a['calibration_s']:.2f} s"
                         f"{', cached' if a['calibration_cached'] else ''}), "
                         f"pool from {_s(a.get('joined_pool_wall'))}, {a.get('local_batches', 0)} batches run "
                         f"without it, first items {_s(a['first_items_wall'])}, {a['leased']} leased, "
                         f"{a['pool_calls']} pool calls ({a['pool_call_s'] - a['pool_held_s']:.2f} s not held), "
                         f"gave {a['given_back']}, continued {a['continued']}")
            lines.append(line)
    return lines


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 small scenarios x 2 pairs: a smoke test")
    parser.add_argument("--seed", type=int, default=0, help="draws the grid's scenarios and the shuffled rows")
    parser.add_argument("--drawn", type=int, default=10, help="scenarios drawn besides the anchors")
    parser.add_argument("--pairs", type=int, default=5, help="off/on pairs per scenario")
    parser.add_argument("--only", default="", help="comma-separated scenario names to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")
    parser.add_argument("--aa", action="store_true",
                        help="the noise floor: both runs of every pair without rebalancing (an A/A test)")
    parser.add_argument("--expert-parallel-size", type=int, default=1,
                        help="N > 1: each engine actor runs N Ray-placed expert-parallel ranks, which divide "
                             "the CPUs evenly (engine_setup); the scenario's max_num_seqs is split over them")
    parser.add_argument("--simulate", action="store_true",
                        help="also predict each run with the rebalancing simulator (calibration: predicted vs measured)")
    parser.add_argument("--out", type=Path, default=Path("runs/skew"))
    parser.add_argument("--from-json", type=Path, help="render the tables of an earlier run's skew.json; run nothing")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        return render(json.loads(args.from_json.read_text()), args.out)
    scenarios = list(QUICK) if args.quick else grid(args.seed, args.drawn)
    pairs = 2 if args.quick else args.pairs
    if args.only:
        scenarios = [s for s in scenarios if s.name in args.only.split(",")]
    if args.list:
        for s in scenarios:
            print(f"{s.name:<14} {s.kind:<9} ideal {s.ideal_steps():>5} steps, without rebalancing up to "
                  f"{s.steps_without_rebalancing():>5}: {s}")
        return []
    command = "benchmarks/skew.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {k: os.environ[k] for k in ("BATCHGEN_DATA_CACHE", "TORCH_EXTENSIONS_DIR") if k in os.environ}
    ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="batchgen-skew-"),
             runtime_env={"env_vars": {**env, "DS_ACCELERATOR": "cpu"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        warm_up(ray, scenarios, args.expert_parallel_size)
        for scenario in scenarios:
            rows = make_rows(scenario, args.seed)
            runs = []
            for k in range(pairs):
                pair = {}
                for rebalance in ((False, True) if k % 2 == 0 else (True, False)):
                    side = "on" if rebalance else "off"
                    stats_dir = args.out / "actor-stats" / f"{scenario.name}-pair{k}-{side}"
                    pair[side] = run_case(ray, scenario, rows, rebalance and not args.aa, stats_dir,
                                          args.expert_parallel_size)
                off, on = pair["off"], pair["on"]
                if args.simulate:
                    pair["predicted"] = predicted(scenario, rows, pair)
                print(f"{scenario.name} pair {k}: off {off['wall_s']:.1f} s (span {off['span_s']:.1f}), "
                      f"on {on['wall_s']:.1f} s (span {on['span_s']:.1f})"
                      + (f"; simulated off {pair['predicted'].get('off_s', 0):.1f} s "
                         f"(at the run's level {pair['predicted'].get('off_level_s', 0):.1f}), "
                         f"on {pair['predicted'].get('on_s', 0):.1f} s ({pair['predicted'].get('on_level_s', 0):.1f})"
                         if args.simulate else ""), flush=True)
                runs.append(pair)
            result = {"scenario": asdict(scenario), "pairs": runs, "summary": summarize(scenario, runs)}
            results.append(result)
            print("\n".join(worst_pair_lines(result)), flush=True)
            (args.out / "skew.json").write_text(json.dumps({"command": command, "cpu": cpu_model(),
                                                             "results": results}, indent=1))
    finally:
        ray.shutdown()
    return render({"command": command, "cpu": cpu_model(), "results": results}, args.out)


def render(run: dict, out: Path) -> list[dict]:
    """Write ``skew.md`` (and ``skew.json``) under ``out`` for a run, its summaries computed again."""
    results = [{**r, "summary": summarize(Scenario(**r["scenario"]), r["pairs"])} for r in run["results"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "skew.json").write_text(json.dumps({**run, "results": results}, indent=1))
    report = table(results, run["command"], run.get("cpu"))
    details = [line for r in results for line in worst_pair_lines(r)]
    (out / "skew.md").write_text(report + "\n\nWhere the time went in each scenario's worst pair:\n\n```\n"
                                 + "\n".join(details) + "\n```\n")
    print("\n" + report)
    print(f"\nwrote {out / 'skew.json'} and {out / 'skew.md'}")
    return results


if __name__ == "__main__":
    main()
