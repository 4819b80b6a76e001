"""Configuration, one home: the engine's (``engine.py``, ``EngineConfig``), speculative decoding's
(``speculative.py``), vLLM's engine arguments as ``EngineConfig`` fields (``engine_args.py``, the
table behind Ray Data LLM's ``engine_kwargs``), and Ray Data LLM's processor and stage configs
(``ray_processor.py``, ``ray_stages.py``; they import Ray, so they are not re-exported here).

This floor imports nothing of the package but ``errors``.
"""

from batchgen_data.config.engine import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    EXPERT_BACKENDS,
    PLACEMENT_STRATEGIES,
    PREFIX_CACHING_HASH_ALGOS,
    RESUME_MODES,
    SUSPEND_POLICIES,
    EngineConfig,
)

__all__ = [
    "DISTRIBUTED_EXECUTOR_BACKENDS",
    "EXPERT_BACKENDS",
    "PLACEMENT_STRATEGIES",
    "PREFIX_CACHING_HASH_ALGOS",
    "RESUME_MODES",
    "SUSPEND_POLICIES",
    "EngineConfig",
]
