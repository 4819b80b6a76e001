"""The engine: sequence-coroutine runtimes over a loaded model.

Owns: the ``Engine`` (``engine.py``: request bookkeeping — ids, seeds, tokenizing, validation,
outputs, stats, the timeline — over an executor) and its asyncio front (``async_engine.py``);
executors (``executor/``: in this process, or over expert-parallel rank processes); sequences
and their lifecycle (``sequence.py``), the inter-forward scheduler and KV block accounting
(``scheduler.py``, ``block_manager.py``: pure Python, no torch, the scheduler the only writer of
its state), the model runner that executes one step with module-based batching
(``model_runner.py``, answering with ``runner_output.py``), sampling with logits processors,
tokenization, outputs, MIGRATE costs and choices (``migration.py``), the running set planned
with the fetch cost of streamed experts (``offload.py``).
May import: ``batchgen_data.model``, config, errors, paths. Never: distributed, operators, jobs.
"""
