"""Grouped-query attention over a flat token batch and paged K/V (RoPE, q/k norm, windows).

Stores K and V per token: ``KVSpec(((Nkv, D), (Nkv, D)))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen_data.model.attention.metadata import AttentionBatch, AttentionMetadata
from batchgen_data.model.attention.spec import KVSpec, LayerKV
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.layers import linear, rms_norm
from batchgen_data.model.rope import RotaryEmbedding


class GQAAttention:
    """One layer's attention. Weights are plain tensors; the KV pages are passed in per call."""

    def __init__(self, config: ModelConfig, layer_id: int, weights: dict[str, torch.Tensor]):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.qk_norm = config.qk_norm
        self.clip_qkv = config.clip_qkv
        self.sliding_window = config.sliding_windows[layer_id]
        self.scale = self.head_dim**-0.5
        # q, k and v run as one GEMM over their stacked weights (and biases, where present).
        self.w_qkv = torch.cat([weights[n] for n in ("q", "k", "v")])  # [(Nq + 2 Nkv) * D, H]
        biases = [weights.get(f"{n}_bias") for n in ("q", "k", "v")]
        self.b_qkv = None if biases[0] is None else torch.cat(biases)
        self.w_o, self.b_o = weights["o"], weights.get("o_bias")
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        self.q_norm, self.k_norm = weights.get("q_norm"), weights.get("k_norm")
        kv_shape = (self.num_kv_heads, self.head_dim)
        self.kv_spec = KVSpec((kv_shape, kv_shape), self.w_qkv.dtype, self.sliding_window)

    def projection_weights(self) -> list[torch.Tensor]:
        return [self.w_qkv, self.w_o]

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        batch: AttentionBatch,
        kv: LayerKV,  # K and V pages, [num_blocks, block_size, Nkv, D] each
    ) -> torch.Tensor:
        k_cache, v_cache = kv
        num_tokens = x.shape[0]
        # Row-major before the head split: SDPA's CPU flash kernel needs unit-stride head dims.
        qkv = linear(x, self.w_qkv, self.b_qkv).contiguous()  # [T, (Nq + 2 Nkv) * D]
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)  # [T, Nq*D], [T, Nkv*D] x2
        if self.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, Nq, D]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Nkv, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        cos, sin = batch.cos_sin
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)

        # Every micro-batch's new KV goes in first: micro-batches hold disjoint sequences.
        k_cache.view(-1, self.num_kv_heads, self.head_dim)[batch.slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, self.num_kv_heads, self.head_dim)[batch.slot_mapping] = v.to(v_cache.dtype)
        if len(batch.micro_batches) == 1:
            out = self._attend(q, batch.micro_batches[0], k_cache, v_cache)
        else:
            out = q.new_empty(num_tokens, self.num_heads * self.head_dim)
            start = 0
            for meta in batch.micro_batches:  # YIELD point: one micro-batch's attention at a time
                num = meta.positions.shape[0]
                out[start : start + num] = self._attend(q[start : start + num], meta, k_cache, v_cache)
                start += num
        return linear(out, self.w_o, self.b_o)  # [T, H]

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [t, Nq, D] of one micro-batch -> attention output [t, Nq * D] over its paged KV."""
        b, qmax = meta.num_seqs, meta.max_query_len
        if qmax == 1:
            # [B, Nq, 1, D], one query per sequence. This stride layout (a transposed [B, 1, Nq, D])
            # keeps SDPA on its CPU flash kernel; other layouts send it to the (GQA-copying) math path.
            q_pad = q.contiguous().view(b, 1, self.num_heads, self.head_dim).transpose(1, 2)
        else:
            q_pad = q.new_zeros(b * qmax, self.num_heads, self.head_dim)
            q_pad[meta.query_index] = q
            q_pad = q_pad.view(b, qmax, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Nq, Q, D]
        # Gather whole pages (contiguous block_size * Nkv * D runs), not single token slots.
        num_keys = meta.block_table.shape[1] * meta.block_size
        pages = meta.block_table.view(-1)  # [B * P]
        k_out, v_out = meta.gather_buffers.get(self.kv_spec.layout, (None, None))
        keys = torch.index_select(k_cache, 0, pages, out=k_out).view(b, num_keys, self.num_kv_heads, self.head_dim)
        values = torch.index_select(v_cache, 0, pages, out=v_out).view(b, num_keys, self.num_kv_heads, self.head_dim)
        keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)  # [B, Nkv, L, D]
        out = F.scaled_dot_product_attention(
            q_pad,
            keys,
            values,
            attn_mask=meta.mask(self.sliding_window),
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Nq, Q, D]
        if qmax == 1:
            return out.reshape(b, self.num_heads * self.head_dim)
        return out.transpose(1, 2).reshape(b * qmax, self.num_heads * self.head_dim)[meta.query_index]
