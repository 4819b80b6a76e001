"""``BatchGenMap``: the Hugging Face ``datasets`` stage.

    ds.map(BatchGenMap(model="demo", max_tokens=64), batched=True, batch_size=64)

``datasets`` calls an object with an async ``__call__`` synchronously (and fails on the returned
coroutine), so this callable is synchronous. It pickles as its config only and loads the engine
lazily, once per process: fingerprinting is fast and identical across runs (a second identical
``.map`` reuses the cache), and ``num_proc=2`` gives each worker process its own engine.
"""

from __future__ import annotations

import os
from functools import partial

import torch
from batchgen_data.operators.columns import RowResult
from batchgen_data.operators.rows import StageConfig
from batchgen_data.operators.stage import finish_batch, prepare_batch

from batchgen_data.engine.engine import Engine
from batchgen_data.heap import HeapTrimmer

# One engine per (model, engine config) per process, created on first use.
_ENGINES: dict[tuple[int, str], Engine] = {}
# This process's heap trims, after batches (heap.py); datasets' forked workers each have their own copy.
_HEAP = HeapTrimmer()
# The process that imported this module; datasets' num_proc workers are forks of it.
_IMPORT_PID = os.getpid()


def _engine_for(config: StageConfig) -> Engine:
    pid = os.getpid()
    key = (pid, f"{config.model}|{config.engine_config!r}")
    if key not in _ENGINES:
        if pid != _IMPORT_PID:
            # A forked worker (num_proc > 1): GNU OpenMP's thread pool does not survive fork, so
            # the first multi-threaded GEMM would hang if the parent ever ran one; the workers
            # share the cores anyway, so each runs single-threaded.
            torch.set_num_threads(1)
        _ENGINES[key] = Engine(config.model, config.engine_config)
    return _ENGINES[key]


class BatchGenMap:
    """A ``datasets.Dataset.map(batched=True)`` function adding the generated columns.

    Takes ``StageConfig.from_kwargs``' arguments, as ``BatchGenOperator`` does (``json_columns``
    and the sampling defaults included) and produces the same output columns, under the same Arrow types
    (``columns.py``). ``Dataset.map`` gets each batch back as an Arrow table, the input columns
    (but ``__input_error__``) followed by the output columns: typed columns are what keep a
    first batch of error rows, or of rows without logprobs, from giving a column the null type
    that later batches cannot be written to. Being returned by the function, the input columns
    stay even if named in ``.map(remove_columns=...)``: drop them with ``.remove_columns``
    after the map. ``IterableDataset.map`` gets a dict of lists. Reading files is
    ``datasets``' job (``load_dataset("json", ...)`` stops at a malformed line); a row with a
    reason in ``__input_error__`` becomes an error row with that message.
    """

    def __init__(self, model: str = "demo", **config):
        self.config = StageConfig.from_kwargs(model=model, **config)

    def __call__(self, batch: dict) -> dict:
        prepared = prepare_batch(batch, self.config)
        results, decode = [], None
        if prepared.valid_rows:  # an all-error batch needs no engine
            engine = _engine_for(self.config)
            outputs = engine.generate(prepared.prompts, prepared.params)
            results = [RowResult.from_output(out) for out in outputs]
            decode = partial(engine.tokenizer.decode, skip_special_tokens=False)
            _HEAP.maybe_trim()  # what the batch's steps freed, back to the OS (heap.py)
        return finish_batch(prepared, results, self.config, decode)

    def __getstate__(self) -> dict:
        return {"config": self.config}

    def __setstate__(self, state: dict) -> None:
        self.config = state["config"]
