"""Decode steps with every layer in one native call (``fused_decode.fused_decode_forward``),
with each decoder block in one call (``fused_attention_block``, ``fused_moe_block``) and on the
per-op path, in one process and alternating, so all three share the machine's state:

    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/fused_ab.py --running 1,2,4,8

For each running-set size N: N rows of 128 random prompt tokens decode; then 6 rounds of 30
steps in each mode; the medians of the per-step times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import batchgen_data.model.decoder as decoder  # noqa: E402
import batchgen_data.model.model as model_module  # noqa: E402
from batchgen_data import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen_data.hardware import cpu_model  # noqa: E402
from benchmarks.decode_steps import ensure_model  # noqa: E402


def _none(*args):
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    fused = {"attention": decoder.fused_attention_block, "moe": decoder.fused_moe_block,
             "forward": model_module.fused_decode_forward}
    engine = Engine(ensure_model(), EngineConfig(max_num_seqs=64))
    rng = random.Random(0)
    print(cpu_model())
    for n in (int(x) for x in args.running.split(",")):
        budget = 10 + 2 * args.rounds * args.steps + 5
        for _ in range(n):
            engine.add_request([rng.randrange(3, 8000) for _ in range(128)],
                               SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))
        for _ in range(10):  # past the prefill
            engine.step()
        ms = {"whole forward": [], "fused blocks": [], "per-op": []}
        for _ in range(args.rounds):
            for mode in ms:
                model_module.fused_decode_forward = fused["forward"] if mode == "whole forward" else _none
                decoder.fused_attention_block = fused["attention"] if mode != "per-op" else _none
                decoder.fused_moe_block = fused["moe"] if mode != "per-op" else _none
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                ms[mode].append(1e3 * (time.perf_counter() - start) / args.steps)
        decoder.fused_attention_block, decoder.fused_moe_block = fused["attention"], fused["moe"]
        model_module.fused_decode_forward = fused["forward"]
        while engine.has_unfinished_requests():
            engine.step()
        whole, blocks, slow = (statistics.median(ms[mode]) for mode in ms)
        print(f"N={n}: whole forward {whole:.2f} ms a step, fused blocks {blocks:.2f} ms ({blocks / whole:.2f}x), "
              f"per-op {slow:.2f} ms ({slow / whole:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
