"""Before/after: the same engine workloads run by this checkout and by an earlier one, same run.

A refactor of the engine core must not change tokens or speed. This runs three workloads of the
project's own benchmarks in alternating subprocesses, one per code tree (``PYTHONPATH`` puts
the tree's ``batchgen_data`` and ``benchmarks`` first), and reports each tree's times and their
ratio per repetition, with a digest of the output tokens (equal digests: identical tokens):

- ``throughput``: ``benchmarks/throughput.py``'s engine run (``run_batchgen``) on its skewed
  workload (256 requests, ``--quick``), greedy; wall seconds;
- ``prefix_cache``: ``benchmarks/prefix_cache.py``'s engine run with caching on (3 templates of
  384 tokens, 16 rows each); wall seconds;
- ``structured``: ``benchmarks/structured.py``'s per-token cost (48 rows x 32 tokens),
  unconstrained, JSON schema, regex and bounded-string JSON; milliseconds per output token.

Usage (an earlier commit checked out beside this one)::

    git worktree add /tmp/before <commit>
    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/before_after.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("throughput", "prefix_cache", "structured")


def _digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def run_workload(name: str) -> dict:
    """One workload in this process, with whatever tree is first on ``sys.path``."""
    from types import SimpleNamespace

    if name == "throughput":
        from benchmarks.throughput import BENCH_MODELS, build_bench_model, run_batchgen
        from benchmarks.workload import make_workload

        from batchgen_data.model import ModelConfig

        folder = Path(os.environ["BATCHGEN_DATA_CACHE"]) / BENCH_MODELS["mixtral"][0]
        build_bench_model(folder, arch="mixtral")
        workload = make_workload(256, 64, 48, ModelConfig.from_pretrained(folder).vocab_size)
        args = SimpleNamespace(device="cpu", dtype="auto", max_num_seqs=256, attention_batch_size=64,
                               max_num_batched_tokens=2048, tune_gemms=True)
        result = run_batchgen(folder, workload, args)
        return {"seconds": result["wall_s"], "digest": _digest(result["outputs"])}
    if name == "prefix_cache":
        from benchmarks.prefix_cache import make_prompts, run_engine

        from batchgen_data.model.demo import ensure_demo_checkpoint
        from batchgen_data.model import ModelConfig

        folder = ensure_demo_checkpoint()
        args = SimpleNamespace(templates=3, rows=16, instruction=384, max_tokens=16, max_num_seqs=256)
        prompts, _ = make_prompts(args, shared=True, vocab=ModelConfig.from_pretrained(folder).vocab_size)
        result = run_engine(folder, prompts, caching=True, args=args)
        return {"seconds": result["wall_s"], "digest": _digest(result["outputs"])}
    if name == "structured":
        from benchmarks.structured import per_token

        from batchgen_data import Engine, EngineConfig

        engine = Engine("demo", EngineConfig(max_num_seqs=64))
        prompts = [f"Row {i}: extract the fields of this customer review, number {i * 7919 % 1000}" for i in range(48)]
        result = per_token(SimpleNamespace(max_tokens=32, reps=3), engine, prompts)
        engine.close()
        return {"ms_per_token": {k: v["median_ms_per_token"] for k, v in result.items()}}
    raise ValueError(name)


def _in_subprocess(tree: Path, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = f"import json, sys; sys.path.insert(0, {str(tree)!r}); from benchmarks.before_after import run_workload; " \
           f"print('RESULT ' + json.dumps(run_workload({name!r})))"
    if not (tree / "benchmarks" / "before_after.py").exists():  # an earlier tree: run this file's function
        code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); import importlib.util as u; "
                f"s = u.spec_from_file_location('ba', {str(Path(__file__))!r}); m = u.module_from_spec(s); "
                f"s.loader.exec_module(m); print('RESULT ' + json.dumps(m.run_workload({name!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{name} in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="an earlier checkout of the repo")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=Path("docs/results/before-after.json"))
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": REPO}
    report: dict[str, list] = {}
    for name in args.workloads.split(","):
        reps = []
        for rep in range(args.reps):
            order = ("before", "after") if rep % 2 == 0 else ("after", "before")
            result = {side: _in_subprocess(trees[side], name) for side in order}
            reps.append(result)
            print(name, rep, json.dumps(result), flush=True)
        report[name] = reps
    print()
    for name, reps in report.items():
        if name == "structured":
            for case in reps[0]["after"]["ms_per_token"]:
                ratios = [r["after"]["ms_per_token"][case] / r["before"]["ms_per_token"][case] for r in reps]
                print(f"structured/{case}: after/before ms per token, median {statistics.median(ratios):.3f} "
                      f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
            continue
        ratios = [r["after"]["seconds"] / r["before"]["seconds"] for r in reps]
        same = all(r["after"]["digest"] == r["before"]["digest"] for r in reps)
        print(f"{name}: after/before wall, median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}); tokens identical: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
