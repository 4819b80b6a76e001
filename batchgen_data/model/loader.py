"""Which module each part of a checkpoint becomes: attention kinds, routers, the expert store."""

from __future__ import annotations

import logging
import math

import torch

from batchgen_data.errors import ConfigError
from batchgen_data.model.attention.gqa import GQAAttention
from batchgen_data.model.attention.mla import MLAAttention
from batchgen_data.model.attention.spec import AttentionLayer
from batchgen_data.model.checkpoint import (
    CheckpointReader,
    moe_prefix,
    read_attention,
    read_mla_attention,
)
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.decoder import DecoderLayer, MoEBlock
from batchgen_data.model.expert_sources import LayerExperts, layer_experts, read_experts
from batchgen_data.model.layers import GatedMLP, SharedExpert
from batchgen_data.model.moe.backends import make_expert_backend
from batchgen_data.model.moe.experts import SWIGLU, ClampedSwiGLU, ExpertActivation, ExpertWeights
from batchgen_data.model.moe.in_place import in_place_tables
from batchgen_data.model.moe.router import Router
from batchgen_data.model.moe.store import (
    ExpertShard,
    ExpertStore,
    ResidentExpertStore,
    ShardedExpertStore,
)
from batchgen_data.model.moe.streamed_store import Fill, StreamedExpertStore

logger = logging.getLogger(__name__)

# Routers that score in fp32 whatever the engine's dtype (transformers keeps their weights fp32).
_FP32_ROUTERS = ("greedy", "group_limited_greedy", "noaux_tc")


def load_expert_store(reader: CheckpointReader, config: ModelConfig, shard: ExpertShard | None = None,
                      weight_memory_bytes: int | None = None, dense_bytes: int = 0) -> ExpertStore:
    """Every sparse layer's experts, resident in this process; with ``shard``, only its experts;
    with ``weight_memory_bytes``, what the budget leaves beside the ``dense_bytes`` of the other
    weights becomes a streamed store's pool (unless the whole model fits)."""
    if weight_memory_bytes is not None:
        store = _streamed_store(reader, config, weight_memory_bytes, dense_bytes)
        if store is not None:
            return store
    owned = None if shard is None else shard.owned(config.num_experts)
    layers = {i: read_experts(reader, moe_prefix(reader, i)[0], config, owned)
              for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)}
    if shard is None:
        return ResidentExpertStore(layers, config.num_experts)
    return ShardedExpertStore(layers, config.num_experts, shard)


def dense_weight_bytes(reader: CheckpointReader, config: ModelConfig) -> int:
    """Every tensor but the routed experts, in the engine's dtype: what stays resident beside
    an expert pool (attention, norms, routers, shared experts, dense layers, embeddings, lm_head)."""
    element = reader.dtype.itemsize
    experts = tuple(f"{moe_prefix(reader, i)[0]}.experts." for i in range(config.num_hidden_layers)
                    if config.is_sparse_layer(i))
    mtp = _mtp_prefixes(config)
    return sum(math.prod(reader.shape(n)) * element for n in reader.names() if not n.startswith(experts + mtp))


def mtp_weight_bytes(reader: CheckpointReader, config: ModelConfig) -> int:
    """The first MTP layer's tensors (``model/mtp.py``; resident when loaded), in the engine's
    dtype, but for the copies of the embedding and head it shares with the main model."""
    first = _mtp_prefixes(config)[:1]
    shared = tuple(f"{p}{name}" for p in first for name in ("embed_tokens.", "shared_head.head."))
    return sum(math.prod(reader.shape(n)) * reader.dtype.itemsize for n in reader.names()
               if n.startswith(first) and not n.startswith(shared))


def _mtp_prefixes(config: ModelConfig) -> tuple[str, ...]:
    """The checkpoint's MTP layers (read only as a draft model, never as main layers)."""
    n = config.num_hidden_layers
    return tuple(f"model.layers.{i}." for i in range(n, n + config.num_nextn_predict_layers))


def _streamed_store(reader: CheckpointReader, config: ModelConfig, budget: int, dense_bytes: int) -> StreamedExpertStore | None:
    """A pool of as many expert slots as ``budget`` holds beside the dense weights; None when
    every expert fits. Every expert's tensors are checked here, at load."""
    sparse = [i for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)]
    layers = {i: layer_experts(reader, moe_prefix(reader, i)[0], config) for i in sparse}
    first = layers[sparse[0]]
    per_expert = first.bytes_per_expert(reader.dtype.itemsize)
    top_k, num_experts = config.num_experts_per_tok, config.num_experts
    minimum = dense_bytes + top_k * per_expert
    if budget < minimum:
        raise ConfigError(
            f"weight_memory_bytes={budget} cannot hold the dense weights ({dense_bytes} bytes) plus one layer's "
            f"{top_k} routed experts ({top_k} x {per_expert} bytes): the minimum is {minimum} bytes "
            f"(the whole model takes {dense_bytes + len(sparse) * num_experts * per_expert})"
        )
    num_slots = (budget - dense_bytes) // per_expert
    if num_slots >= len(sparse) * num_experts:
        logger.info("weight_memory_bytes=%d holds the whole model: experts stay resident", budget)
        return None
    return StreamedExpertStore(_tier(layers, reader), sparse, num_experts, num_slots, first.hidden, first.ffn,
                               first.has_bias, reader.dtype, reader.device,
                               in_place=in_place_tables(layers, reader.folder, reader.dtype, reader.device))


def _tier(layers: dict[int, LayerExperts], reader: CheckpointReader) -> Fill:
    """Where the pool is filled from: on CPU the checkpoint's memory map itself; for a GPU pool a
    pinned host copy of every expert (asynchronous copies on the store's own stream)."""
    if torch.device(reader.device).type != "cuda":
        return lambda layer, expert, pool, slot: layers[layer].fill(expert, pool, slot)
    host: dict[int, ExpertWeights] = {}
    for i, layer in layers.items():
        host[i] = ExpertWeights.empty(layer.num_experts, layer.hidden, layer.ffn, layer.has_bias, reader.dtype, "cpu",
                                      pin_memory=True)
        for e in range(layer.num_experts):
            layer.fill(e, host[i], e)
    return lambda layer, expert, pool, slot: host[layer].copy_row(expert, pool, slot, non_blocking=True)


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
                ffn=load_ffn(reader, config, i, store, expert_backend, expert_parallel_size),
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


def load_ffn(reader: CheckpointReader, config: ModelConfig, layer_id: int, store: ExpertStore,
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
