"""Embedding benchmark: ``Engine.embed`` vs transformers hidden-state extraction, in one run.

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/embed.py   # ~3 min

Workload: ``--rows`` prompts of ``--min-tokens``..``--max-tokens`` random token ids (uniform
lengths), the same for both systems. Models (``--models``): the demo model (Qwen3-MoE layout,
hidden 256, 8 experts, 4 layers) and the throughput benchmark's Mixtral (hidden 768, 8 experts,
4 layers, 206 M parameters; ``benchmarks/workload.py``), fp32.

* batchgen-data: ``Engine.embed`` over all rows (prefill-only requests, chunks of
  ``--max-num-batched-tokens`` per forward, router and experts on the combined batch), prefix
  caching off so a repetition recomputes everything.
* transformers: the checkpoint's base model (``AutoModel``: the decoder and its final norm) on
  right-padded batches with an attention mask, the last real position's state L2-normalized:
  batches of ``--hf-batch-size`` rows (default: all of them, the engine's batch) in input order,
  and batches of ``--hf-sorted-batch-size`` rows sorted by length (its best case on this
  workload: little padding, GEMMs still large).

Both run in this process with the same torch thread count (``--threads``), alternating,
``--repeats`` times after a warm-up; each reports its best repetition (rows/s; process CPU
seconds beside, which other processes on the machine inflate less than wall time), and the ratios
are engine / same-batch baseline and engine / best baseline. The outputs are compared (max abs
difference of the embeddings). Writes ``embed.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen_data import Engine, EngineConfig  # noqa: E402
from batchgen_data.paths import cache_dir  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from benchmarks.workload import BENCH_MODELS, build_bench_model  # noqa: E402


def model_folder(name: str) -> Path:
    if name == "demo":
        from batchgen_data.model.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    folder = cache_dir() / BENCH_MODELS[name][0]
    build_bench_model(folder, arch=name)
    return folder


def make_rows(args, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_tokens, args.max_tokens))]
            for _ in range(args.rows)]


def run_engine(engine: Engine, rows: list[list[int]]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    outs = engine.embed(rows)
    wall = time.perf_counter() - start
    return wall, torch.tensor([o.embeddings for o in outs])


def timed(run) -> tuple[float, float, torch.Tensor]:
    """(wall s, process CPU s, outputs) of one run."""
    cpu = time.process_time()
    wall, out = run()
    return wall, time.process_time() - cpu, out


def run_hf(model, rows: list[list[int]], batch_size: int, sort_by_length: bool,
           pad_id: int) -> tuple[float, torch.Tensor]:
    order = sorted(range(len(rows)), key=lambda i: len(rows[i])) if sort_by_length else list(range(len(rows)))
    found: dict[int, torch.Tensor] = {}
    start = time.perf_counter()
    with torch.inference_mode():
        for k in range(0, len(order), batch_size):
            batch = order[k : k + batch_size]
            width = max(len(rows[i]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, : len(rows[i])] = torch.tensor(rows[i])
                mask[j, : len(rows[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, W, H]
            last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]  # [B, H]
            for i, state in zip(batch, F.normalize(last, dim=-1)):
                found[i] = state
    wall = time.perf_counter() - start
    return wall, torch.stack([found[i] for i in range(len(rows))])


def bench_model(name: str, args) -> dict:
    from transformers import AutoModel

    folder = model_folder(name)
    engine = Engine(folder, EngineConfig(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         enable_prefix_caching=False))
    hf = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = make_rows(args, engine.model_config.vocab_size)
    pad_id = engine.model_config.pad_token_id or 0
    same = f"hf-bs{args.hf_batch_size or args.rows}"
    systems = {
        "batchgen-data": lambda: run_engine(engine, rows),
        same: lambda: run_hf(hf, rows, args.hf_batch_size or args.rows, False, pad_id),
        f"hf-bs{args.hf_sorted_batch_size}-sorted": lambda: run_hf(hf, rows, args.hf_sorted_batch_size, True, pad_id),
    }
    warm = make_rows(argparse.Namespace(rows=4, min_tokens=16, max_tokens=32), engine.model_config.vocab_size, 1)
    engine.embed(warm)
    run_hf(hf, warm, 4, False, pad_id)
    walls: dict[str, list[float]] = {k: [] for k in systems}
    cpus: dict[str, list[float]] = {k: [] for k in systems}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):  # alternating, so drift of the machine hits every system alike
        for key, run in systems.items():
            wall, cpu, outputs[key] = timed(run)
            walls[key].append(wall)
            cpus[key].append(cpu)
    best = {k: min(v) for k, v in walls.items()}
    rows_per_s = {k: args.rows / w for k, w in best.items()}
    baseline = max((k for k in systems if k != "batchgen-data"), key=lambda k: rows_per_s[k])
    stats = engine.stats()
    result = {
        "model": name, "params_m": round(sum(p.numel() for p in hf.parameters()) / 1e6, 1),
        "num_rows": args.rows, "num_tokens": sum(map(len, rows)),
        "wall_s": walls, "cpu_s": cpus, "rows_per_s": rows_per_s,
        "tokens_per_s": {k: v * sum(map(len, rows)) / args.rows for k, v in rows_per_s.items()},
        "best_baseline": baseline, "ratio": rows_per_s["batchgen-data"] / rows_per_s[baseline],
        "ratio_same_batch": rows_per_s["batchgen-data"] / rows_per_s[same],
        "cpu_ratio": min(cpus[baseline]) / min(cpus["batchgen-data"]),
        "max_abs_diff": max((outputs["batchgen-data"] - outputs[k]).abs().max().item() for k in systems),
        "engine_mean_tokens_per_expert_call": stats.mean_tokens_per_expert_call,
        "engine_forwards_per_run": stats.num_forwards // (args.repeats + 1),
    }
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["demo", "mixtral"], choices=["demo", *BENCH_MODELS])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="rows per transformers batch in input order (default: --rows)")
    parser.add_argument("--hf-sorted-batch-size", type=int, default=8,
                        help="rows per transformers batch sorted by length (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("runs/embed"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
              "load_average_start": os.getloadavg(), "results": []}
    for name in args.models:
        result = bench_model(name, args)
        report["results"].append(result)
        print(f"{name} ({result['params_m']} M params, {result['num_rows']} rows, {result['num_tokens']} tokens): "
              + ", ".join(f"{k} {v:.1f} rows/s" for k, v in result["rows_per_s"].items())
              + f"; batchgen-data is {result['ratio_same_batch']:.2f}x the same batch, {result['ratio']:.2f}x "
              + f"{result['best_baseline']} ({result['cpu_ratio']:.2f}x in CPU seconds)"
              + f" (max |diff| {result['max_abs_diff']:.1e}, {result['engine_mean_tokens_per_expert_call']:.0f}"
              + " tokens per expert call)", flush=True)
    report["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embed.json").write_text(json.dumps(report, indent=2))
    print(f"cpu: {cpu}, {report['threads']} threads, load average {report['load_average_start'][0]:.1f} -> "
          f"{report['load_average_end'][0]:.1f} (other processes share the cores) -> {args.out / 'embed.json'}")


if __name__ == "__main__":
    main()
