"""The engine: sequence-coroutine runtimes over a loaded model, grouped by role (as vLLM v1).

- The front, at this level: the ``Engine`` (``engine.py``: request bookkeeping — ids, seeds,
  tokenizing, validation, request handles, outputs, stats, the timeline — over an executor), its
  asyncio front (``async_engine.py``), ``SamplingParams``, tokenization, outputs and stats.
- ``core/`` (torch-free): request records and their lifecycle, the scheduler (policy), the KV
  manager over the block pool with the prefix cache, the scheduler/runner contract.
- ``executor/``: where sequences run (in this process, or over expert-parallel rank processes).
- ``worker/``: the model runner (module-based batching) and the offload planner.
- ``sample/``: the sampler and its steps, the grammar bitmask kernel, logprob capture.
- ``structured/``: grammars for structured outputs (compile, match).
- ``migration/`` (torch-free): what a MIGRATE costs, the step-time model, the move rule.
May import: ``batchgen_data.model``, config, errors, paths. Never: distributed, operators, jobs.
"""
