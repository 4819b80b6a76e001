"""Skew benchmark: cross-actor rebalancing vs Ray Data's block-to-actor assignment.

    .venv/bin/python benchmarks/skew.py             # ~5 min on 2 CPUs

Two ``BatchGenOperator`` actors on the demo model, each case run with ``rebalance=False`` and
``rebalance=True`` in the same run:
  * clustered: the long outputs sit together in the last blocks (sorted input, the common case);
  * uniform: the same rows shuffled.
Reports batch completion time and each actor's idle fraction, writes ``skew.json`` and a per-actor
timeline ``skew_timeline.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import BatchGenOperator  # noqa: E402


def make_rows(num_rows: int, num_long: int, short_tokens: int, long_tokens: int, clustered: bool, seed: int = 0):
    rng = random.Random(seed)
    lens = [short_tokens] * (num_rows - num_long) + [long_tokens] * num_long  # sorted: long ones last
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
    actors = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("actor-*.json"))]
    per_actor = []
    for a in actors:
        busy = sum(step["step_s"] for step in a["timeline"])
        per_actor.append({"pid": a["pid"], "busy_s": busy, "idle_fraction": max(0.0, 1 - busy / wall),
                          "rebalance": a["rebalance"],
                          "timeline": [(a["start_wall"] + s["t"] - start, s["num_running"], s["num_waiting"])
                                       for s in a["timeline"]]})
    return {"rebalance": rebalance, "completion_s": wall, "num_output_tokens": sum(r["num_generated_tokens"] for r in out),
            "actors": per_actor}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--long-rows", type=int, default=128)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--actors", type=int, default=2)
    # Fewer running slots than rows per actor, as in any real job (the KV budget bounds the
    # running set; blocks hold far more rows): work queues behind each actor's running set.
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--cases", default="clustered,uniform", help="which cases to run")
    parser.add_argument("--out", type=Path, default=Path("runs/skew"))
    args = parser.parse_args(argv)

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {k: os.environ[k] for k in ("BATCHGEN_DATA_CACHE",) if k in os.environ}
    ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="batchgen-skew-"),
             runtime_env={"env_vars": {**env, "DS_ACCELERATOR": "cpu"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    results = {}
    try:
        warm_up(ray, args)
        for case, clustered in (("clustered", True), ("uniform", False)):
            if case not in args.cases.split(","):
                continue
            rows = make_rows(args.rows, args.long_rows, args.short_tokens, args.long_tokens, clustered)
            for rebalance in (False, True):
                key = f"{case}/{'rebalance' if rebalance else 'no-rebalance'}"
                results[key] = run_case(ray, rows, args, rebalance, args.out / "actor-stats" / key.replace("/", "-"))
                print(f"{key:<26} {results[key]['completion_s']:7.1f} s   idle "
                      + ", ".join(f"{a['idle_fraction']:.0%}" for a in results[key]["actors"]), flush=True)
    finally:
        ray.shutdown()
    summary = {}
    if "clustered/rebalance" in results:
        summary["clustered_speedup"] = (results["clustered/no-rebalance"]["completion_s"]
                                        / results["clustered/rebalance"]["completion_s"])
        print(f"\nclustered: rebalancing finishes {summary['clustered_speedup']:.2f}x sooner (target >= 1.4x)")
    if "uniform/rebalance" in results:
        summary["uniform_slowdown"] = (results["uniform/rebalance"]["completion_s"]
                                       / results["uniform/no-rebalance"]["completion_s"] - 1)
        print(f"uniform:   rebalancing is {100 * summary['uniform_slowdown']:+.1f}% slower (target <= +5%)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "skew.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "summary": summary, "cases": results}, indent=2))
    _plot(results, args.out / "skew_timeline.png")
    print(f"wrote {args.out / 'skew.json'} and {args.out / 'skew_timeline.png'}")
    return summary


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.4 * len(results)), sharex=True)
    for ax, (key, r) in zip(axes, results.items()):
        for i, actor in enumerate(r["actors"]):
            xs = [t for t, _, _ in actor["timeline"]]
            ys = [n for _, n, _ in actor["timeline"]]
            ax.step(xs, ys, where="post", label=f"actor {i} (idle {actor['idle_fraction']:.0%})")
        ax.axvline(r["completion_s"], color="grey", linestyle=":")
        ax.set_title(f"{key}: {r['completion_s']:.1f} s", fontsize=10)
        ax.set_ylabel("running seqs")
        ax.legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("seconds since the job started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
