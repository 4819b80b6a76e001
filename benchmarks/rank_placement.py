"""What Ray-placed expert-parallel ranks cost against local rank processes, in one run.

    .venv/bin/python benchmarks/expert_parallel.py --ranks ray,local     # N = 2 on CPU, ~4 min

Both engines (``distributed_executor_backend="mp"`` and ``"ray"``, each N ranks of one torch
thread per CPU they get) are built once on the same machine; the same skewed workload then runs
on each in turn, ``--reps`` times alternating, and the medians are compared: output tokens/s,
the mean lockstep step, and the share of the ranks' step time inside the MoE collectives. The
local ranks bind to their own CPUs (their default outside Ray); Ray-placed ranks cannot (Ray
assigns no cores; other actors share the node's). Target (issue #34): Ray-placed within 10% of
local throughput at N = 2. Writes ``rank_placement.json`` under ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from batchgen_data import Engine, EngineConfig, SamplingParams


BACKENDS = {"local": "mp", "ray": "ray"}  # --ranks names -> distributed_executor_backend


def _engine(folder, name: str, args) -> Engine:
    threads = max(1, (os.cpu_count() or 1) // args.size)
    config = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          attention_batch_size=args.attention_batch_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, expert_parallel_size=args.size,
                          distributed_executor_backend=BACKENDS[name], rank_resources={"CPU": float(threads)})
    return Engine(folder, config)


def _rep(engine: Engine, workload) -> dict:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    base = engine.stats()
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    stats = engine.stats()
    before = {r.rank: r for r in base.ranks}
    busy = sum(r.busy_s - before[r.rank].busy_s for r in stats.ranks)
    comm = sum(r.expert_comm_s - before[r.rank].expert_comm_s for r in stats.ranks)
    tokens = sum(o.num_generated_tokens for o in outputs)
    steps = stats.num_forwards - base.num_forwards
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "step_ms": 1e3 * wall / steps, "num_steps": steps,
            "comm_share": comm / busy if busy else 0.0, "outputs": [o.token_ids for o in outputs]}


def compare(folder, workload, args, backends: list[str]) -> dict:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {k: os.environ[k] for k in ("BATCHGEN_DATA_CACHE", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR") if k in os.environ}
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="batchgen-ray-"), runtime_env={"env_vars": env})
    engines = {}
    try:
        for backend in backends:
            start = time.perf_counter()
            engines[backend] = _engine(folder, backend, args)
            engines[backend].generate(workload.prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            print(f"{backend}: started and warmed in {time.perf_counter() - start:.1f} s", flush=True)
        reps: dict[str, list[dict]] = {b: [] for b in backends}
        for rep in range(args.reps):
            for backend in (backends if rep % 2 == 0 else backends[::-1]):  # alternate who goes first
                reps[backend].append(_rep(engines[backend], workload))
                r = reps[backend][-1]
                print(f"  rep {rep} {backend:>5}: {r['tokens_per_s']:.1f} tok/s, step {r['step_ms']:.2f} ms, "
                      f"in collectives {100 * r['comm_share']:.1f}%", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
        ray.shutdown()
    medians = {b: {k: statistics.median(r[k] for r in reps[b]) for k in ("tokens_per_s", "step_ms", "comm_share")}
               for b in backends}
    print(f"\n{'ranks':>6}{'tok/s (median)':>16}{'step ms':>9}{'in collectives':>16}")
    for b in backends:
        m = medians[b]
        print(f"{b:>6}{m['tokens_per_s']:>16.1f}{m['step_ms']:>9.2f}{100 * m['comm_share']:>15.1f}%")
    summary: dict = {"medians": medians, "reps": {b: [{k: v for k, v in r.items() if k != "outputs"} for r in reps[b]]
                                                  for b in backends}}
    if len(backends) == 2:
        ray_r, local = medians["ray"], medians["local"]
        summary["ray_over_local_throughput"] = ray_r["tokens_per_s"] / local["tokens_per_s"]
        summary["identical_outputs"] = all(a["outputs"] == b["outputs"] for a, b in zip(*reps.values()))
        summary["target_within_10pct"] = summary["ray_over_local_throughput"] >= 0.9
        print(f"Ray-placed / local throughput: {summary['ray_over_local_throughput']:.3f} (target >= 0.90); "
              f"identical outputs: {summary['identical_outputs']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rank_placement.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}, indent=2))
    print(f"wrote {path}")
    return summary
