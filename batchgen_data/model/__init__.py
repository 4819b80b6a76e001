"""The model layer: checkpoint loading and the maths of a MoE transformer over flat token batches.

Owns: ``config.py`` (a checkpoint's shape and options), ``checkpoint.py``, ``expert_sources.py``
(every expert layout, one expert into one row) and ``loader.py`` (safetensors to modules), ``attention/`` (one file per attention kind behind ``KVSpec``),
``moe/`` (routers, the expert contract, expert stores and backends), ``layers.py`` and
``gemm_tuning.py`` (every projection's GEMM, dispatched by measured kernel choice: not only the
experts', so it lives here rather than in ``moe/``), ``kv_cache.py`` (the paged pool, laid out by
the layers' specs), ``decoder.py`` and ``model.py`` (the module call order), ``demo.py`` and
``resolve.py`` (the demo checkpoint; model names to folders).
May import: config, errors, paths. Never: engine, distributed, operators, jobs.
"""

from batchgen_data.model.config import ModelConfig
from batchgen_data.model.model import MoEModel

__all__ = ["ModelConfig", "MoEModel"]
