"""Expert backends by name: ``native`` (grouped per-expert GEMM) and ``deepspeed`` (DeepSpeed-MoE)."""

from __future__ import annotations

from batchgen_data.config.engine import EXPERT_BACKENDS
from batchgen_data.errors import ConfigError
from batchgen_data.model.moe.experts import SWIGLU, ExpertActivation, ExpertBackend
from batchgen_data.model.moe.store import ExpertStore


def make_expert_backend(name: str, store: ExpertStore, layer_id: int,
                        activation: ExpertActivation = SWIGLU, expert_parallel_size: int = 1) -> ExpertBackend:
    """Build the named backend over layer ``layer_id`` of ``store``.

    Across expert-parallel ranks (``expert_parallel_size`` > 1) tokens always travel through
    DeepSpeed-MoE's all-to-all, whatever ``name`` says: the native backend is single-process.
    """
    if expert_parallel_size > 1:
        from batchgen_data.model.moe.deepspeed_backend import DeepSpeedExperts

        return DeepSpeedExperts(store, layer_id, activation, ep_size=expert_parallel_size)
    if name == "native":
        from batchgen_data.model.moe.native_backend import NativeExperts

        return NativeExperts(store, layer_id, activation)
    if name == "deepspeed":
        from batchgen_data.model.moe.deepspeed_backend import DeepSpeedExperts

        return DeepSpeedExperts(store, layer_id, activation)
    raise ConfigError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {name!r}")
