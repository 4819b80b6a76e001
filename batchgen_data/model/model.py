"""A MoE transformer as separately callable modules over flat token batches.

embed -> [attention(l) -> router(l) -> experts(l) (+ shared expert)] x L -> norm -> lm_head

The engine calls the modules one by one (attention per micro-batch, router and experts on the
combined batch); ``forward`` runs them in order for a single batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from batchgen_data.model.attention import Attention
from batchgen_data.model.attention_metadata import AttentionBatch, AttentionMetadata
from batchgen_data.model.checkpoint import (
    CheckpointReader,
    moe_prefix,
    read_attention,
    read_experts,
)
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.experts import ExpertBackend, ExpertWeights, make_expert_backend
from batchgen_data.model.kv_cache import KVCache
from batchgen_data.model.layers import GatedMLP, SharedExpert, linear, rms_norm
from batchgen_data.model.rope import RotaryEmbedding
from batchgen_data.model.router import Router


@dataclass(slots=True)
class MoEBlock:
    """Router, experts and optional shared expert of one sparse layer."""

    router: Router
    experts: ExpertBackend
    shared_expert: SharedExpert | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> ([T, H], tokens per expert [E])."""
        out = self.experts(x, self.router(x))
        hidden = out.hidden
        if self.shared_expert is not None:
            hidden = hidden + self.shared_expert(x)
        return hidden, out.tokens_per_expert


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor  # [H]
    attention: Attention
    post_attention_norm: torch.Tensor  # [H]
    ffn: MoEBlock | GatedMLP
    eps: float

    def attention_block(self, h, batch: AttentionBatch, k_cache, v_cache) -> torch.Tensor:
        """Residual attention sub-block: h + attn(norm(h)), attention per micro-batch of ``batch``."""
        return h + self.attention(rms_norm(h, self.input_norm, self.eps), batch, k_cache, v_cache)

    def ffn_block(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Residual FFN sub-block: h + moe(norm(h)); also the tokens per expert (None if dense)."""
        x = rms_norm(h, self.post_attention_norm, self.eps)
        if isinstance(self.ffn, MoEBlock):
            out, counts = self.ffn(x)
            return h + out, counts
        return h + self.ffn(x), None


class MoEModel:
    """The model's weights as modules; see the module docstring for the call order."""

    def __init__(self, config, embed_tokens, layers, norm, lm_head, device, dtype):
        self.config: ModelConfig = config
        self.embed_tokens = embed_tokens  # [V, H]
        self.layers: list[DecoderLayer] = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H]
        self.device, self.dtype = device, dtype
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_backend: str = "native",
    ) -> "MoEModel":
        config = ModelConfig.from_pretrained(folder)
        reader = CheckpointReader(folder, dtype, device)
        layers = []
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            ffn: MoEBlock | GatedMLP
            if config.is_sparse_layer(i):
                moe = moe_prefix(reader, i)
                router = Router(reader.get(f"{moe}.gate.weight"), config.num_experts_per_tok, config.norm_topk_prob)
                experts = make_expert_backend(expert_backend, read_experts(reader, moe, config))
                shared = None
                if reader.has(f"{moe}.shared_expert.gate_proj.weight"):
                    shared = SharedExpert(_read_mlp(reader, f"{moe}.shared_expert"), reader.get(f"{moe}.shared_expert_gate.weight"))
                ffn = MoEBlock(router, experts, shared)
            else:
                ffn = _read_mlp(reader, f"{prefix}.mlp")
            layers.append(
                DecoderLayer(
                    input_norm=reader.get(f"{prefix}.input_layernorm.weight"),
                    attention=Attention(config, i, read_attention(reader, i)),
                    post_attention_norm=reader.get(f"{prefix}.post_attention_layernorm.weight"),
                    ffn=ffn,
                    eps=config.rms_norm_eps,
                )
            )
        embed = reader.get("model.embed_tokens.weight")
        if config.tie_word_embeddings or not reader.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = reader.get("lm_head.weight")
        return cls(config, embed, layers, reader.get("model.norm.weight"), lm_head, device, dtype)

    def gemm_weights(self, max_batched_tokens: int, max_sampled_rows: int) -> tuple[dict, dict]:
        """The weights ``linear`` multiplies, by (N, K) shape in model order, and the most rows
        each shape sees in one call (for GEMM tuning)."""
        weights: dict[tuple[int, int], list[torch.Tensor]] = {}
        max_rows: dict[tuple[int, int], int] = {}

        def add(w: torch.Tensor, rows: int) -> None:
            shape = (w.shape[0], w.shape[1])
            weights.setdefault(shape, []).append(w)
            max_rows[shape] = max(rows, max_rows.get(shape, 0))

        for layer in self.layers:
            add(layer.attention.w_qkv, max_batched_tokens)
            add(layer.attention.w_o, max_batched_tokens)
            ffn = layer.ffn
            mlps = [ffn] if isinstance(ffn, GatedMLP) else []
            if isinstance(ffn, MoEBlock):
                mlps += [ffn.shared_expert.mlp] if ffn.shared_expert is not None else []
                experts = getattr(ffn.experts, "weights", None)  # the native backend's stacked weights
                if isinstance(experts, ExpertWeights):
                    routed = max_batched_tokens * self.config.num_experts_per_tok
                    for e in range(experts.num_experts):
                        add(experts.w_gate_up[e], routed)
                        add(experts.w_down[e], routed)
            for mlp in mlps:
                add(mlp.w_gate_up, max_batched_tokens)
                add(mlp.w_down, max_batched_tokens)
        add(self.lm_head, max_sampled_rows)
        return weights, max_rows

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(self.config, num_blocks, block_size, self.dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (usually the last token of each sequence) -> fp32 logits [N, V]."""
        logits = linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.lm_head)  # [N, V]
        return logits.float().contiguous()  # row-major: the sampler reduces along V

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        expert_counts: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run all layers on one flat batch; returns the final hidden states [T, H] (pre-norm)."""
        h = self.embed(input_ids)
        batch = AttentionBatch.combine([meta], self.rotary, self.dtype)
        for layer_id, layer in enumerate(self.layers):
            h = layer.attention_block(h, batch, kv_cache.k[layer_id], kv_cache.v[layer_id])
            h, counts = layer.ffn_block(h)
            if expert_counts is not None and counts is not None:
                expert_counts.append(counts)
        return h


def _read_mlp(reader: CheckpointReader, prefix: str) -> GatedMLP:
    gate = reader.get(f"{prefix}.gate_proj.weight")
    up = reader.get(f"{prefix}.up_proj.weight")
    return GatedMLP(torch.cat([gate, up], dim=0), reader.get(f"{prefix}.down_proj.weight"))
