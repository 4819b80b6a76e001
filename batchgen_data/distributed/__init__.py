"""What spans actors: the shared work pool of one pipeline stage's actors.

Owns: ``work_pool.py`` (items, leases, results, batches; pure Python; its items are
``work_item.py``, who shares them is ``members.py``) and ``coordinator.py`` (the Ray actor
holding a pool per stage, which holds lease calls open until there is work for them). What moves at
the tail is decided by the engine's move rule (``batchgen_data.engine.migration.planner``), the
same one an engine's expert-parallel ranks use. An engine's own rank processes (expert parallelism) are one of
its executors: ``batchgen_data.engine.executor``.
May import: ``batchgen_data.engine``, ``batchgen_data.model``, config, errors. Never: operators,
jobs.
"""
