"""Which module each part of a checkpoint becomes: attention kinds, routers, the expert store."""

from __future__ import annotations

import torch

from batchgen_data.model.attention.gqa import GQAAttention
from batchgen_data.model.attention.spec import AttentionLayer
from batchgen_data.model.checkpoint import (
    CheckpointReader,
    moe_prefix,
    read_attention,
    read_experts,
)
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.decoder import DecoderLayer, MoEBlock
from batchgen_data.model.layers import GatedMLP, SharedExpert
from batchgen_data.model.moe.backends import make_expert_backend
from batchgen_data.model.moe.router import Router
from batchgen_data.model.moe.store import ExpertStore, ResidentExpertStore


def load_expert_store(reader: CheckpointReader, config: ModelConfig) -> ExpertStore:
    """Every sparse layer's experts, resident in this process."""
    layers = {i: read_experts(reader, moe_prefix(reader, i), config)
              for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)}
    return ResidentExpertStore(layers, config.num_experts)


def load_layers(reader: CheckpointReader, config: ModelConfig, store: ExpertStore, expert_backend: str) -> list[DecoderLayer]:
    layers = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        layers.append(
            DecoderLayer(
                input_norm=reader.get(f"{prefix}.input_layernorm.weight"),
                attention=load_attention(reader, config, i),
                post_attention_norm=reader.get(f"{prefix}.post_attention_layernorm.weight"),
                ffn=_load_ffn(reader, config, i, store, expert_backend),
                eps=config.rms_norm_eps,
            )
        )
    return layers


def load_attention(reader: CheckpointReader, config: ModelConfig, layer_id: int) -> AttentionLayer:
    return GQAAttention(config, layer_id, read_attention(reader, layer_id))


def _load_ffn(reader: CheckpointReader, config: ModelConfig, layer_id: int, store: ExpertStore,
              expert_backend: str) -> MoEBlock | GatedMLP:
    if not config.is_sparse_layer(layer_id):
        return read_mlp(reader, f"model.layers.{layer_id}.mlp")
    moe = moe_prefix(reader, layer_id)
    router = Router(reader.get(f"{moe}.gate.weight"), config.num_experts_per_tok, config.norm_topk_prob)
    shared = None
    if reader.has(f"{moe}.shared_expert.gate_proj.weight"):
        shared = SharedExpert(read_mlp(reader, f"{moe}.shared_expert"), reader.get(f"{moe}.shared_expert_gate.weight"))
    return MoEBlock(router, make_expert_backend(expert_backend, store, layer_id), shared)


def read_mlp(reader: CheckpointReader, prefix: str) -> GatedMLP:
    gate = reader.get(f"{prefix}.gate_proj.weight")
    up = reader.get(f"{prefix}.up_proj.weight")
    return GatedMLP(torch.cat([gate, up], dim=0), reader.get(f"{prefix}.down_proj.weight"))
