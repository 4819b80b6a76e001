"""The engine: one process's sequence-coroutine runtime over a loaded model.

Owns: sequences and their lifecycle (``sequence.py``), the inter-forward scheduler and KV block
accounting (``scheduler.py``, ``block_manager.py``: pure Python, no torch), the model runner that
executes one step with module-based batching (``model_runner.py``), sampling, tokenization,
outputs, the ``Engine`` (``engine.py``: schedule, execute, update) and its asyncio front
(``async_engine.py``), the running set planned with the fetch cost of streamed experts
(``offload.py``).
May import: ``batchgen_data.model``, config, errors, paths. Never: distributed, operators, jobs.
"""
