"""Offloading benchmark: a model whose routed experts are 3x+ the weight budget, run by this engine
with streamed experts and by Hugging Face accelerate's big-model offloading at the same budget,
beside this engine fully resident. One command, same prompts and output lengths for every system:

    .venv/bin/python benchmarks/offload.py             # CPU, ~6 min
    bash benchmarks/offload_gpu.sh                      # one GPU, pinned host tier (untested)

Systems, each in its own freshly spawned interpreter (its peak memory is its own):
  batchgen-data resident             every weight in memory
  batchgen-data streamed             ``weight_memory_bytes=budget`` (the default eviction and
                                     prefetch; on CPU decode steps read the experts in place from
                                     the memory-mapped checkpoint), plus three variants: LRU
                                     eviction with next-layer prefetch (the first design), no
                                     prefetch, and every read through the pool (no reads in place)
  accelerate static                  ``device_map="auto", max_memory={"cpu": budget},
                                     offload_folder=...``; transformers ``generate`` on padded
                                     batches sorted by output length (the oracle best case) at
                                     each of ``--accelerate-batch-sizes``; the best one counts
  accelerate per-prompt              the same, one prompt at a time, on the first
                                     ``--per-prompt`` requests

Reports output tokens/s, expert bytes fetched per output token (accelerate: the weights it
offloaded, which its hooks load from the offload folder on every forward, times its forwards),
each system's peak anonymous RSS (``RssAnon``, sampled every 2 ms: not the page cache of the
memory-mapped checkpoint) and whether the greedy tokens match the resident run. Writes
``offload.json`` and ``offload_timeline.png`` (fetch vs compute per step of the streamed run)
under ``--out``. Targets (issue #17): streamed >= 5x the best accelerate configuration;
streamed >= 50% of resident; streamed peak RSS within budget + KV + the engine's overhead at this
configuration (the resident run's peak less its weights and KV: runtime, activations, kernel
workspaces; ``tests/engine/test_offload_memory.py`` checks a fixed overhead for a small config).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import BENCH_MODELS, build_bench_model, make_workload, percentile  # noqa: E402

MiB = 1 << 20


# -- one system per interpreter -------------------------------------------------------------------

class _AnonPeak:
    """Samples this process's RssAnon in a thread; ``peak`` is the largest seen."""

    def __init__(self):
        self.peak, self._done = self.now(), threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def stop(self) -> int:
        self._done.set()
        self.peak = max(self.peak, self.now())
        return self.peak


def child_batchgen(spec: dict) -> dict:
    from batchgen_data import Engine, EngineConfig, SamplingParams

    memory = _AnonPeak()
    workload = make_workload(**spec["workload"])
    config = EngineConfig(device=spec["device"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
                          max_num_batched_tokens=spec["max_num_batched_tokens"], kv_cache_memory_bytes=spec["kv_bytes"],
                          weight_memory_bytes=spec["budget"], collect_timeline=True)
    start = time.perf_counter()
    engine = Engine(spec["folder"], config)
    load_s = time.perf_counter() - start
    store = engine.executor.model.expert_store
    if spec.get("eviction"):
        store.eviction = spec["eviction"]
    if spec.get("prefetch") is False:
        store.prefetch = False
    if spec.get("read_in_place") is False:
        store.read_in_place = False
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.generate(workload.prompts[:4], warm)
    engine.timeline.clear()
    before = engine.stats()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    tokens = sum(o.num_generated_tokens for o in outputs)
    result = {"wall_s": wall, "load_s": load_s, "num_output_tokens": tokens, "tokens_per_s": tokens / wall,
              "num_steps": stats.num_forwards - before.num_forwards, "peak_anon_bytes": memory.stop(),
              "peak_gpu_bytes": _peak_gpu_bytes(spec["device"]), "outputs": [o.token_ids for o in outputs],
              "timeline": engine.timeline}
    if stats.offload is not None:
        o, b = stats.offload, before.offload
        result.update(
            bytes_fetched=o.bytes_fetched - b.bytes_fetched, hit_rate=_rate(o.num_hits - b.num_hits, o.num_misses - b.num_misses),
            fetch_s=o.fetch_s - b.fetch_s, fetch_wait_s=o.fetch_wait_s - b.fetch_wait_s, pool_bytes=o.pool_bytes,
            pool_slots=o.pool_slots, dense_bytes=o.resident_dense_bytes, model_expert_bytes=o.model_expert_bytes,
            fetch_bytes_per_s=o.fetch_bytes_per_s, planned_running_seqs=o.planned_running_seqs,
            predicted_fetch_share=o.predicted_fetch_share, read_in_place=o.read_in_place)
    return result


def _peak_gpu_bytes(device: str) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0


def _rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def child_accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.hf_baselines import run_static

    memory = _AnonPeak()
    workload = make_workload(**spec["workload"])
    prompts, lens = workload.prompts, workload.output_lens
    if spec["per_prompt"]:
        prompts, lens = prompts[: spec["per_prompt"]], lens[: spec["per_prompt"]]
    device = spec["device"]
    max_memory = {"cpu": spec["budget"]} if device == "cpu" else {0: spec["budget"], "cpu": spec["host_bytes"]}
    dtype = torch.float32 if spec["dtype"] in ("auto", "float32") and device == "cpu" else torch.bfloat16
    with tempfile.TemporaryDirectory(dir=spec["offload_dir"]) as offload:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(spec["folder"], device_map="auto", max_memory=max_memory,
                                                     offload_folder=offload, dtype=dtype).eval()
        load_s = time.perf_counter() - start
        placement = dict(model.hf_device_map)
        offloaded = sum(p.numel() * p.element_size() for name, p in _params_by_placement(model, placement,
                                                                                         ("disk", "cpu") if device != "cpu" else ("disk",)))
        forwards = [0]
        model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        result = run_static(model, prompts, lens, batch_size=1 if spec["per_prompt"] else spec["batch_size"],
                            sort_by_length=not spec["per_prompt"])
    return {"wall_s": result.wall_s, "load_s": load_s, "num_output_tokens": result.num_output_tokens,
            "tokens_per_s": result.tokens_per_s, "peak_anon_bytes": memory.stop(),
            "peak_gpu_bytes": _peak_gpu_bytes(device), "outputs": result.output_token_ids,
            "num_forwards": forwards[0], "offloaded_bytes": offloaded, "bytes_fetched": offloaded * forwards[0],
            "placement": {k: str(v) for k, v in placement.items()}}


def _params_by_placement(model, placement: dict, where: tuple[str, ...]):
    """(name, parameter) of the modules ``device_map`` put in ``where`` (the slower tiers). The
    offloaded parameters sit on the meta device, so their sizes come from the config's shapes."""
    for name, param in model.named_parameters():
        owner = max((m for m in placement if name == m or name.startswith(m + ".") or m == ""), key=len, default=None)
        if owner is not None and str(placement[owner]) in where:
            yield name, param


# -- the parent -----------------------------------------------------------------------------------

def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{spec['system']} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot_timeline(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = run["timeline"]
    t0 = steps[0]["t"] - steps[0]["step_s"]
    starts = [s["t"] - s["step_s"] - t0 for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(3, 1))
    top.bar(starts, [s["step_s"] for s in steps], width=[s["step_s"] for s in steps], align="edge",
            color="#bbbbbb", label="step (wall)")
    top.bar(starts, [s["fetch_s"] for s in steps], width=[s["step_s"] for s in steps], align="edge", alpha=0.7,
            color="#d62728", label="fetch thread copying")
    top.bar(starts, [s["fetch_wait_s"] for s in steps], width=[s["step_s"] for s in steps], align="edge",
            color="#1f1f1f", label="compute waiting for a fetch")
    top.set_ylabel("seconds in the step")
    top.set_yscale("log")
    top.legend(loc="upper right")
    top.set_title("batchgen-data, streamed experts: fetch vs compute per step")
    bottom.step(starts, [s["num_running"] for s in steps], where="post", color="#1f77b4")
    bottom.set_ylabel("running sequences", color="#1f77b4")
    fetched = bottom.twinx()
    fetched.step(starts, [s["fetched_bytes"] / 2**30 for s in steps], where="post", color="#d62728")
    fetched.set_ylabel("GiB fetched", color="#d62728")
    bottom.set_xlabel("seconds since the first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(BENCH_MODELS), default="mixtral_16e")
    parser.add_argument("--budget", default="400MB", help="weight budget for both offloading systems")
    parser.add_argument("--kv", default="256MiB", help="this engine's KV budget")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--p95-output", type=int, default=32)
    parser.add_argument("--median-prompt", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--accelerate-batch-sizes", default="32,64")
    parser.add_argument("--per-prompt", type=int, default=4, help="requests accelerate runs one at a time")
    parser.add_argument("--no-variants", action="store_true", help="skip the LRU, no-prefetch and through-pool runs")
    parser.add_argument("--through-pool", action="store_true",
                        help="with --no-variants, still run the streamed engine with every read through the pool")
    parser.add_argument("--skip-accelerate", action="store_true", help="this engine's runs only (a quick look)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host-memory", default="200GiB", help="GPU runs: accelerate's CPU tier")
    parser.add_argument("--out", type=Path, default=Path("runs/offload"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        result = (child_accelerate if spec["system"].startswith("accelerate") else child_batchgen)(spec)
        print(json.dumps(result))
        return result

    from batchgen_data.jobs.sizes import parse_byte_size
    from batchgen_data.model import ModelConfig

    budget, kv_bytes = parse_byte_size(args.budget), parse_byte_size(args.kv)
    cache = Path(os.environ.get("BATCHGEN_DATA_CACHE", Path.home() / ".cache" / "batchgen-data"))
    folder = cache / BENCH_MODELS[args.arch][0]
    if not (folder / "config.json").is_file():
        build_bench_model(folder, arch=args.arch)
    mcfg = ModelConfig.from_pretrained(folder)
    workload = dict(num_requests=args.requests, p95_output=args.p95_output, median_prompt=args.median_prompt,
                    vocab=mcfg.vocab_size)
    lens = make_workload(**workload).output_lens
    args.out.mkdir(parents=True, exist_ok=True)
    base = dict(folder=str(folder), workload=workload, device=args.device, dtype=args.dtype, budget=budget,
                kv_bytes=kv_bytes, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                offload_dir=str(args.out),
                host_bytes=parse_byte_size(args.host_memory))
    print(f"model: {mcfg.num_params / 1e6:.0f} M params, {mcfg.num_experts} experts x {mcfg.num_hidden_layers} layers; "
          f"weight budget {budget / MiB:.0f} MiB, KV {kv_bytes / MiB:.0f} MiB; {args.requests} requests, "
          f"{sum(lens)} output tokens (P50 {percentile(lens, .5):.0f}, P95 {percentile(lens, .95):.0f}, max {max(lens)})",
          flush=True)
    runs: dict[str, dict] = {}

    def run(name: str, **spec) -> dict:
        runs[name] = run_child({**base, "system": name, **spec})
        r = runs[name]
        gpu = f", peak GPU {r['peak_gpu_bytes'] / MiB:.0f} MiB" if r["peak_gpu_bytes"] else ""
        print(f"  {name}: {r['tokens_per_s']:.1f} tok/s ({r['wall_s']:.1f} s), peak RssAnon "
              f"{r['peak_anon_bytes'] / MiB:.0f} MiB{gpu}", flush=True)
        return r

    resident = run("batchgen-data resident", budget=None)
    streamed = run("batchgen-data streamed", budget=budget)
    if not args.no_variants:
        run("batchgen-data streamed, LRU + next-layer prefetch", eviction="lru")
        run("batchgen-data streamed, no prefetch", prefetch=False)
    if not args.no_variants or args.through_pool:
        run("batchgen-data streamed, every read through the pool", read_in_place=False)
    if not args.skip_accelerate:
        for bs in [int(b) for b in args.accelerate_batch_sizes.split(",")]:
            run(f"accelerate static bs{bs}", batch_size=bs, per_prompt=0)
        run("accelerate per-prompt", batch_size=1, per_prompt=args.per_prompt)
    best_accelerate = max((r["tokens_per_s"] for n, r in runs.items() if n.startswith("accelerate")), default=float("nan"))
    # The engine's memory besides weights and KV at this configuration (runtime, activations of
    # max_num_batched_tokens, kernel workspaces), measured on the resident run of the same run.
    overhead = resident["peak_anon_bytes"] - streamed["dense_bytes"] - streamed["model_expert_bytes"] - kv_bytes
    bound = budget + kv_bytes + overhead

    print(f"\n{'system':<52}{'tok/s':>8}{'MiB fetched/token':>19}{'peak RssAnon MiB':>18}{'same tokens':>13}")
    for name, r in runs.items():
        fetched = r.get("bytes_fetched", 0) / r["num_output_tokens"] / MiB
        same = f"{sum(a == b for a, b in zip(r['outputs'], resident['outputs']))}/{len(r['outputs'])}"
        print(f"{name:<52}{r['tokens_per_s']:>8.1f}{fetched:>19.1f}{r['peak_anon_bytes'] / MiB:>18.0f}{same:>13}")
    print(f"\nstreamed: pool {streamed['pool_slots']} experts ({streamed['pool_bytes'] / MiB:.0f} MiB) + dense "
          f"{streamed['dense_bytes'] / MiB:.0f} MiB; model experts {streamed['model_expert_bytes'] / MiB:.0f} MiB "
          f"({streamed['model_expert_bytes'] / budget:.1f}x the budget); hit rate {streamed['hit_rate']:.2f}; "
          f"fetch {streamed['fetch_s']:.1f} s, compute waited {streamed['fetch_wait_s']:.1f} s; fetch rate at load "
          f"{streamed['fetch_bytes_per_s'] / 1e9:.1f} GB/s; planned running set {streamed['planned_running_seqs']}")
    targets = {
        "vs_best_accelerate": streamed["tokens_per_s"] / best_accelerate,
        "vs_resident": streamed["tokens_per_s"] / resident["tokens_per_s"],
        "peak_rss_within_bound": streamed["peak_anon_bytes"] <= bound,
    }
    met = {"vs_best_accelerate": targets["vs_best_accelerate"] >= 5.0, "vs_resident": targets["vs_resident"] >= 0.5,
           "peak_rss_within_bound": targets["peak_rss_within_bound"]}
    print(f"streamed vs best accelerate: {targets['vs_best_accelerate']:.2f}x (target 5x); vs resident: "
          f"{100 * targets['vs_resident']:.0f}% (target 50%); peak RssAnon {streamed['peak_anon_bytes'] / MiB:.0f} MiB vs "
          f"budget + KV + overhead {bound / MiB:.0f} MiB (overhead {overhead / MiB:.0f} MiB: the resident run's peak "
          f"less its weights and KV); met: {met}")
    plot_timeline(streamed, args.out / "offload_timeline.png")
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "targets": targets, "met": met, "bound_bytes": bound,
              "overhead_bytes": overhead,
              "runs": {n: {k: v for k, v in r.items() if k not in ("outputs", "timeline")} for n, r in runs.items()},
              "streamed_timeline": streamed["timeline"]}
    (args.out / "offload.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out / 'offload.json'} and {args.out / 'offload_timeline.png'}")
    return report


if __name__ == "__main__":
    main()
