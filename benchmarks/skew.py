"""Skew benchmark: does cross-actor rebalancing pay where it can, and cost nothing where it can't?

    .venv/bin/python benchmarks/skew.py             # ~9 min on 2 CPUs (5 repetitions)

Two ``BatchGenOperator`` actors on the demo model (``ActorPoolStrategy(size=2)``, 0.5 CPU each),
each running at most ``--max-num-seqs`` sequences at once. Short rows ask for ``--short-tokens``
tokens, long rows for ``--long-tokens``; the long rows sit together in the first block (sorted
input, the common case). Three workloads, each repetition in one Ray cluster:

  * in-set (control): few long rows (``--in-set-long-rows``), all fitting in one actor's running
    set beside its short rows: nothing to gain from moving work, so rebalancing must cost nothing;
  * queued: more long rows (``--queued-long-rows``) than one running set holds, so without
    rebalancing they queue behind each other in the actor that got their block;
  * shuffled: the queued rows shuffled, without rebalancing: the reference a perfect
    rebalancer should match.

Ratios are taken within a repetition (no rebalancing over rebalancing), and the order of the
runs alternates between repetitions. Reports min / median / max of each ratio, and where each
run's time went per actor (steps, idle gaps, work-pool calls, moves with their KV bytes and
seconds, recomputed tokens). Writes ``skew.json`` and a per-actor timeline ``skew_timeline.png``
(the median repetition) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import BatchGenOperator  # noqa: E402

# A gap between two engine steps longer than this counts as idle time on the timeline.
_IDLE_GAP_S = 0.2


def make_rows(num_rows: int, num_long: int, short_tokens: int, long_tokens: int, clustered: bool, seed: int = 0):
    rng = random.Random(seed)
    lens = [long_tokens] * num_long + [short_tokens] * (num_rows - num_long)  # sorted: long ones first
    if not clustered:
        rng.shuffle(lens)
    return [{"id": i, "prompt": f"Order {i}: the parcel {rng.randrange(10**6)} arrived damaged, please advise.",
             "sampling_params": {"max_tokens": n, "ignore_eos": True}} for i, n in enumerate(lens)]


def warm_up(ray, args) -> None:
    """One small untimed job first, so no timed case pays the cold start alone (worker processes,
    imports from a cold page cache, the demo checkpoint, the engine's GEMM plan)."""
    rows = make_rows(4 * args.actors, 0, 4, 4, clustered=True)
    ray.data.from_items(rows).repartition(args.actors).map_batches(
        BatchGenOperator, fn_constructor_kwargs={"model": args.model, "rebalance": False}, batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=args.actors), num_cpus=0.5,
    ).take_all()


def run_case(ray, rows, args, rebalance: bool, stats_dir: Path) -> dict:
    shutil.rmtree(stats_dir, ignore_errors=True)
    stats_dir.mkdir(parents=True)
    ds = ray.data.from_items(rows).repartition(args.blocks)
    start = time.time()
    out = ds.map_batches(
        BatchGenOperator,
        fn_constructor_kwargs={"model": args.model, "engine_config": {"max_num_seqs": args.max_num_seqs},
                               "rebalance": rebalance, "stats_dir": str(stats_dir)},
        batch_size=args.batch_size,
        compute=ray.data.ActorPoolStrategy(size=args.actors, max_concurrent_calls_per_actor=args.concurrency,
                                           # no batches queued behind a busy actor's running ones
                                           max_tasks_in_flight_per_actor=args.concurrency),
        num_cpus=0.5,
    ).take_all()
    wall = time.time() - start
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows], "rows lost or duplicated"
    actors = [where_time_went(json.loads(p.read_text()), start, wall) for p in sorted(stats_dir.glob("actor-*.json"))]
    return {"rebalance": rebalance, "completion_s": wall,
            "num_output_tokens": sum(r["num_generated_tokens"] for r in out), "actors": actors}


def where_time_went(report: dict, job_start: float, wall: float) -> dict:
    """One actor's run: engine steps, idle gaps, work-pool calls, moves, recompute."""
    steps = report["timeline"]
    at = [report["start_wall"] + s["t"] - job_start for s in steps]  # each step's end, job time
    busy = sum(s["step_s"] for s in steps)
    gaps = [(a - s["step_s"]) - b for a, b, s in zip(at[1:], at, steps[1:])]
    reb = report["rebalance"] or {}
    return {
        "pid": report["pid"], "num_steps": len(steps), "busy_s": busy,
        "first_step_s": at[0] - steps[0]["step_s"] if steps else None, "last_step_s": at[-1] if steps else None,
        "idle_gap_s": sum(g for g in gaps if g > _IDLE_GAP_S), "idle_fraction": max(0.0, 1 - busy / wall),
        "pool_calls": reb.get("num_pool_calls", 0), "pool_call_s": reb.get("pool_call_s", 0.0),
        "given_back": reb.get("num_given_back", 0), "continued": reb.get("num_continued", 0),
        "moved_kv_bytes": reb.get("migrated_out_bytes", 0), "migrate_out_s": reb.get("migrate_out_s", 0.0),
        "recomputed_tokens": reb.get("num_recomputed_tokens", 0),
        "run_for_others": reb.get("num_run_for_others", 0),
        "moves": [(t - job_start, what, s, n, b) for t, what, s, n, b in reb.get("events", [])],
        "timeline": [(t, s["num_running"], s["num_waiting"]) for t, s in zip(at, steps)],
    }


RUNS = (  # (run name, workload, rebalance)
    ("in-set/no-rebalance", "in-set", False),
    ("in-set/rebalance", "in-set", True),
    ("queued/no-rebalance", "queued", False),
    ("queued/rebalance", "queued", True),
    ("shuffled/no-rebalance", "shuffled", False),
)
# Not run by default: rebalancing where the input is already even (what it costs there).
EXTRA_RUNS = (("shuffled/rebalance", "shuffled", True),)


def ratios(rep: dict) -> dict:
    t = {name: r["completion_s"] for name, r in rep.items()}
    return {
        "in_set": t["in-set/no-rebalance"] / t["in-set/rebalance"],
        "queued": t["queued/no-rebalance"] / t["queued/rebalance"],
        "queued_vs_shuffled": t["queued/rebalance"] / t["shuffled/no-rebalance"],
    }


TARGETS = {"in_set": (">=", 0.97), "queued": (">=", 1.4), "queued_vs_shuffled": ("<=", 1.10)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--in-set-long-rows", type=int, default=4)
    parser.add_argument("--queued-long-rows", type=int, default=32)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--actors", type=int, default=2)
    # Fewer running slots than rows per actor, as in any real job (the KV budget bounds the
    # running set; blocks hold far more rows): work queues behind each actor's running set.
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", default=",".join(name for name, _, _ in RUNS),
                        help="which runs, comma-separated: " + ", ".join(n for n, _, _ in RUNS + EXTRA_RUNS))
    parser.add_argument("--out", type=Path, default=Path("runs/skew"))
    args = parser.parse_args(argv)

    import ray

    workloads = {
        "in-set": make_rows(args.rows, args.in_set_long_rows, args.short_tokens, args.long_tokens, clustered=True),
        "queued": make_rows(args.rows, args.queued_long_rows, args.short_tokens, args.long_tokens, clustered=True),
        "shuffled": make_rows(args.rows, args.queued_long_rows, args.short_tokens, args.long_tokens, clustered=False),
    }
    chosen = [run for run in RUNS + EXTRA_RUNS if run[0] in args.runs.split(",")]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {k: os.environ[k] for k in ("BATCHGEN_DATA_CACHE",) if k in os.environ}
    ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="batchgen-skew-"),
             runtime_env={"env_vars": {**env, "DS_ACCELERATOR": "cpu"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    reps: list[dict] = []
    try:
        warm_up(ray, args)
        for rep in range(args.reps):
            results = {}
            for name, workload, rebalance in (chosen if rep % 2 == 0 else chosen[::-1]):
                stats_dir = args.out / "actor-stats" / f"rep{rep}-{name.replace('/', '-')}"
                results[name] = r = run_case(ray, workloads[workload], args, rebalance, stats_dir)
                print(f"rep {rep}  {name:<22} {r['completion_s']:6.1f} s  " + summary_line(r), flush=True)
            reps.append({name: results[name] for name, _, _ in chosen})
    finally:
        ray.shutdown()
    summary = {}
    if all(run in chosen for run in RUNS):
        per_rep = [ratios(rep) for rep in reps]
        print(f"\n{'ratio':<38}{'min':>7}{'median':>8}{'max':>7}   target (every repetition)")
        for key, label in (("in_set", "in-set control: no-reb / reb"), ("queued", "queued skew: no-reb / reb"),
                           ("queued_vs_shuffled", "queued reb / shuffled no-reb")):
            values = [r[key] for r in per_rep]
            op, bound = TARGETS[key]
            met = all(v >= bound if op == ">=" else v <= bound for v in values)
            summary[key] = {"values": values, "min": min(values), "median": statistics.median(values),
                            "max": max(values), "target": f"{op} {bound}", "met": met}
            print(f"{label:<38}{min(values):7.3f}{statistics.median(values):8.3f}{max(values):7.3f}"
                  f"   {op} {bound}: {'met' if met else 'MISSED'}")
    if reps and all(name in reps[0] for name in ("shuffled/no-rebalance", "shuffled/rebalance")):
        values = [rep["shuffled/no-rebalance"]["completion_s"] / rep["shuffled/rebalance"]["completion_s"] for rep in reps]
        summary["shuffled"] = {"values": values, "min": min(values), "median": statistics.median(values), "max": max(values)}
        print(f"{'shuffled: no-reb / reb':<38}{min(values):7.3f}{statistics.median(values):8.3f}{max(values):7.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "skew.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "summary": summary, "reps": reps}, indent=2))
    if reps:
        median_rep = _median_rep(reps, summary)
        _plot(reps[median_rep], args.out / "skew_timeline.png", median_rep)
        print(f"wrote {args.out / 'skew.json'} and {args.out / 'skew_timeline.png'} (repetition {median_rep})")
    return summary


def summary_line(r: dict) -> str:
    parts = []
    for a in r["actors"]:
        part = (f"[{a['num_steps']} steps {a['busy_s']:.1f}s, first {a['first_step_s']:.1f} last {a['last_step_s']:.1f}"
                f", gaps {a['idle_gap_s']:.1f}s")
        if r["rebalance"]:
            part += (f", pool {a['pool_calls']}x {a['pool_call_s']:.2f}s, gave {a['given_back']}"
                     f" ({a['moved_kv_bytes'] / 1e6:.1f} MB, {a['migrate_out_s']:.2f}s), continued {a['continued']}"
                     f", recomputed {a['recomputed_tokens']}")
        parts.append(part + "]")
    return " ".join(parts)


def _median_rep(reps: list[dict], summary: dict) -> int:
    if "queued" not in summary:
        return len(reps) - 1
    values = summary["queued"]["values"]
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def _plot(rep: dict, path: Path, index: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rep), 1, figsize=(9, 2.2 * len(rep)), sharex=True, squeeze=False)
    for ax, (key, r) in zip(axes[:, 0], rep.items()):
        for i, actor in enumerate(r["actors"]):
            xs = [t for t, _, _ in actor["timeline"]]
            ax.step(xs, [n for _, n, _ in actor["timeline"]], where="post", color=f"C{i}",
                    label=f"actor {i}: running (idle {actor['idle_fraction']:.0%} of the job)")
            ax.step(xs, [n for _, _, n in actor["timeline"]], where="post", color=f"C{i}", linestyle="--",
                    alpha=0.6, label=f"actor {i}: waiting")
            for t, what, _, n, _ in actor["moves"]:
                ax.axvline(t, color=f"C{i}", alpha=0.5, linestyle="-." if what == "give_back" else ":")
        ax.axvline(r["completion_s"], color="grey", linestyle=":")
        ax.set_title(f"{key}: {r['completion_s']:.1f} s", fontsize=10)
        ax.set_ylabel("sequences")
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel(f"seconds since the job started (repetition {index}; dash-dot: gave back, dotted: continued)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
