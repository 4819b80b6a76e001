"""What spans actors: the shared work pool of one pipeline stage's actors.

Owns: ``work_pool.py`` (items, leases, results; pure Python) and ``coordinator.py`` (the Ray
actor holding a pool per stage). An engine's own rank processes (expert parallelism) are one of
its executors: ``batchgen_data.engine.executor``.
May import: ``batchgen_data.engine``, ``batchgen_data.model``, config, errors. Never: operators,
jobs.
"""
