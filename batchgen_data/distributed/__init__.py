"""What spans processes: the shared work pool, its coordinator actor, and the cost of MIGRATE.

Owns: ``work_pool.py`` (items, leases, results; pure Python), ``coordinator.py`` (the Ray actor
holding a pool per stage), ``migration.py`` (when moving a sequence to another engine pays, and
whether its KV travels).
May import: ``batchgen_data.engine``, ``batchgen_data.model``, config, errors. Never: operators,
jobs.
"""
