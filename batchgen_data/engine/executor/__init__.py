"""Executors: where an engine's sequence coroutines run.

The ``Engine`` (``engine/engine.py``) does request bookkeeping once — ids, seeds, tokenizing,
validation, request handles, outputs, the timeline — and hands each valid request to its
executor (a ``NewRequest``), which owns the scheduler(s), KV and model runner(s) and publishes the
requests' progress after each step (``ExecutorStep``):

- ``in_process.py``: ``InProcessExecutor``, one scheduler, KV pool and model runner in this
  process (also what each expert-parallel rank runs over its shard of the experts);
- ``expert_parallel.py``: ``ExpertParallelExecutor``, N rank processes (DP attention, EP MoE,
  DeepSpeed-MoE all-to-all) in lockstep, with ``rank_group.py`` (start, command, stop),
  ``rank_worker.py`` (one rank), ``rank_protocol.py`` (what they say to each other),
  ``rank_resources.py`` (a rank's CPUs and memory) and ``comm_time.py`` (wait vs exchange).

Both satisfy ``Executor`` (``base.py``). May import: the rest of ``batchgen_data.engine``,
``batchgen_data.model``, config, errors, paths.
"""
