"""Which way an expert-parallel engine starts its ranks: local child processes or Ray actors.

``EngineConfig.distributed_executor_backend`` (vLLM's name) decides: ``"mp"`` starts
``rank_group.RankGroup`` (processes on this node), ``"ray"`` starts ``ray_rank_group.RayRankGroup``
(actors in one placement group, possibly over several machines), and None picks Ray when it is
initialized in this process — inside a Ray Data actor, a ``--workers`` / ``--address`` job, or a
driver that called ``ray.init`` — and local processes otherwise. Both give the executor the same
contract: ``ready``, ``step(commands)``, ``close(kill)``, ``pids``.
"""

from __future__ import annotations

import sys

from batchgen_data.config import EngineConfig


def rank_backend(config: EngineConfig) -> str:
    """``"mp"`` or ``"ray"`` for this config in this process."""
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    ray = sys.modules.get("ray")
    return "ray" if ray is not None and ray.is_initialized() else "mp"


def start_rank_group(model_path, config: EngineConfig, world_size: int):
    """The started rank group (``RankGroup`` or ``RayRankGroup``) of ``world_size`` ranks."""
    if rank_backend(config) == "ray":
        import ray

        from batchgen_data.engine.executor.ray_rank_group import RayRankGroup

        if not ray.is_initialized():  # as vLLM's "ray" backend: join RAY_ADDRESS or start a local Ray
            ray.init()
        return RayRankGroup(model_path, config, world_size)
    from batchgen_data.engine.executor.rank_group import RankGroup

    return RankGroup(model_path, config, world_size)
