"""xgrammar vs llguidance on the demo vocabulary: how the grammar library was chosen.

    # xgrammar is not a dependency: put it beside the project, without triton (unused on CPU)
    .venv/bin/pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi
    BATCHGEN_DATA_CACHE=$PWD/.cache/batchgen-data .venv/bin/python benchmarks/grammar_libraries.py --xgrammar-path /tmp/xgr

For each library: building its tokenizer view (once per engine), compiling a schema, and
filling the masks of 48 rows for 32 steps of a decode, for the extraction schemas of
``benchmarks/structured.py``. Each row advances by the token a fixed random "model" (a random
logits row per sequence) likes best among the allowed ones, as greedy decoding of a random model
does. Without ``--xgrammar-path`` only llguidance is measured. Install cost is measured apart
(docs/structured-outputs.md gives the commands).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.structured import BOUNDED_SCHEMA, LONG_SCHEMA  # noqa: E402

SCHEMAS = {"extraction": LONG_SCHEMA, "bounded_string": BOUNDED_SCHEMA}


def allowed_best(mask_row: np.ndarray, preference: np.ndarray) -> int:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[: len(preference)].astype(bool)
    return int(np.argmax(np.where(bits, preference, -np.inf)))


def run_llguidance(hf, vocab: int, rows: int, steps: int, preferences: np.ndarray) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llg_numpy

    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    out = {"tokenizer_view_s": time.perf_counter() - start}
    executor = llguidance.LLExecutor()
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        first = llguidance.LLMatcher(tokenizer, grammar)
        out[f"{name}_compile_ms"] = 1e3 * (time.perf_counter() - start)
        matchers = [first.deep_copy() for _ in range(rows)]
        mask = llg_numpy.allocate_token_bitmask(rows, vocab)
        fill = 0.0
        for _ in range(steps):
            live = [(m, i) for i, m in enumerate(matchers) if not m.is_stopped()]
            start = time.perf_counter()
            llg_numpy.fill_next_token_bitmask_par(executor, live, mask)
            fill += time.perf_counter() - start
            for m, i in live:
                m.consume_token(allowed_best(mask[i], preferences[i]))
        out[f"{name}_fill_ms_per_step"] = 1e3 * fill / steps
    return out


def run_xgrammar(hf, vocab: int, rows: int, steps: int, preferences: np.ndarray) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    out = {"tokenizer_view_s": time.perf_counter() - start}
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    batch = xgrammar.BatchGrammarMatcher(max_threads=2)
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        out[f"{name}_compile_ms"] = 1e3 * (time.perf_counter() - start)
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
        mask = xgrammar.allocate_token_bitmask(rows, vocab)
        fill = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            batch.batch_fill_next_token_bitmask(matchers, mask)
            fill += time.perf_counter() - start
            host = mask.numpy()
            for i, m in enumerate(matchers):
                if not m.is_terminated():
                    m.accept_token(allowed_best(host[i], preferences[i]))
        out[f"{name}_fill_ms_per_step"] = 1e3 * fill / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--xgrammar-path", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from batchgen_data.model import ModelConfig
    from batchgen_data.model.resolve import resolve_model

    folder = resolve_model("demo")
    hf = AutoTokenizer.from_pretrained(str(folder))
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    preferences = np.random.default_rng(0).standard_normal((args.rows, vocab)).astype(np.float32)
    results = {"llguidance": run_llguidance(hf, vocab, args.rows, args.steps, preferences)}
    if args.xgrammar_path is not None:
        sys.path.insert(0, str(args.xgrammar_path))
        results["xgrammar"] = run_xgrammar(hf, vocab, args.rows, args.steps, preferences)
    for library, values in results.items():
        print(library, {k: round(v, 3) for k, v in values.items()})


if __name__ == "__main__":
    main()
