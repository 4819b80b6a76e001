"""Which module each part of a checkpoint becomes: attention kinds, routers, the expert store."""

from __future__ import annotations

import torch

from batchgen_data.model.attention.gqa import GQAAttention
from batchgen_data.model.attention.mla import MLAAttention
from batchgen_data.model.attention.spec import AttentionLayer
from batchgen_data.model.checkpoint import (
    CheckpointReader,
    moe_prefix,
    read_attention,
    read_experts,
    read_mla_attention,
)
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.decoder import DecoderLayer, MoEBlock
from batchgen_data.model.layers import GatedMLP, SharedExpert
from batchgen_data.model.moe.backends import make_expert_backend
from batchgen_data.model.moe.experts import SWIGLU, ClampedSwiGLU, ExpertActivation
from batchgen_data.model.moe.router import Router
from batchgen_data.model.moe.store import (
    ExpertShard,
    ExpertStore,
    ResidentExpertStore,
    ShardedExpertStore,
)

# Routers that score in fp32 whatever the engine's dtype (transformers keeps their weights fp32).
_FP32_ROUTERS = ("greedy", "group_limited_greedy", "noaux_tc")


def load_expert_store(reader: CheckpointReader, config: ModelConfig, shard: ExpertShard | None = None) -> ExpertStore:
    """Every sparse layer's experts, resident in this process; with ``shard``, only its experts."""
    owned = None if shard is None else shard.owned(config.num_experts)
    layers = {i: read_experts(reader, moe_prefix(reader, i)[0], config, owned)
              for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)}
    if shard is None:
        return ResidentExpertStore(layers, config.num_experts)
    return ShardedExpertStore(layers, config.num_experts, shard)


def load_layers(reader: CheckpointReader, config: ModelConfig, store: ExpertStore, expert_backend: str,
                expert_parallel_size: int = 1) -> list[DecoderLayer]:
    layers = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        layers.append(
            DecoderLayer(
                input_norm=reader.get(f"{prefix}.input_layernorm.weight"),
                attention=load_attention(reader, config, i),
                post_attention_norm=reader.get(f"{prefix}.post_attention_layernorm.weight"),
                ffn=_load_ffn(reader, config, i, store, expert_backend, expert_parallel_size),
                eps=config.rms_norm_eps,
            )
        )
    return layers


def load_attention(reader: CheckpointReader, config: ModelConfig, layer_id: int) -> AttentionLayer:
    if config.attention_kind == "mla":
        return MLAAttention(config, layer_id, read_mla_attention(reader, layer_id))
    return GQAAttention(config, layer_id, read_attention(reader, layer_id))


def expert_activation(config: ModelConfig) -> ExpertActivation:
    if config.swiglu_limit is None:
        return SWIGLU
    return ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit)


def _load_ffn(reader: CheckpointReader, config: ModelConfig, layer_id: int, store: ExpertStore,
              expert_backend: str, expert_parallel_size: int) -> MoEBlock | GatedMLP:
    if not config.is_sparse_layer(layer_id):
        return read_mlp(reader, f"model.layers.{layer_id}.mlp")
    moe, router_name = moe_prefix(reader, layer_id)
    dtype = torch.float32 if config.router.kind in _FP32_ROUTERS else None
    router = Router(
        reader.get(f"{moe}.{router_name}.weight", dtype),
        config.num_experts_per_tok,
        config.router,
        bias=reader.optional(f"{moe}.{router_name}.bias"),
        correction_bias=reader.optional(f"{moe}.{router_name}.e_score_correction_bias", torch.float32),
    )
    shared: SharedExpert | GatedMLP | None = None
    if reader.has(f"{moe}.shared_expert.gate_proj.weight"):  # Qwen2-MoE: one shared expert, gated
        shared = SharedExpert(read_mlp(reader, f"{moe}.shared_expert"), reader.get(f"{moe}.shared_expert_gate.weight"))
    elif reader.has(f"{moe}.shared_experts.gate_proj.weight") and config.shared_expert_intermediate_size:
        shared = read_mlp(reader, f"{moe}.shared_experts")  # DeepSeek, GLM: n_shared_experts fused, ungated
    backend = make_expert_backend(expert_backend, store, layer_id, expert_activation(config), expert_parallel_size)
    return MoEBlock(router, backend, shared)


def read_mlp(reader: CheckpointReader, prefix: str) -> GatedMLP:
    gate = reader.get(f"{prefix}.gate_proj.weight")
    up = reader.get(f"{prefix}.up_proj.weight")
    return GatedMLP(torch.cat([gate, up], dim=0), reader.get(f"{prefix}.down_proj.weight"))
