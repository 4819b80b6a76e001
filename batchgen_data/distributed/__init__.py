"""What spans processes: the actors' shared work pool, and an engine's expert-parallel ranks.

Owns: ``work_pool.py`` (items, leases, results; pure Python), ``coordinator.py`` (the Ray actor
holding a pool per stage), ``migration.py`` (when moving a sequence to another engine pays, and
whether its KV travels), and expert parallelism: ``expert_parallel.py`` (the ``Engine`` over N
ranks), ``rank_group.py`` (starting, commanding in lockstep and stopping the rank processes),
``rank_worker.py`` (one rank), ``rank_protocol.py`` (what they say to each other).
May import: ``batchgen_data.engine``, ``batchgen_data.model``, config, errors. Never: operators,
jobs. (``engine.engine`` imports ``expert_parallel`` back: the one listed exception.)
"""
