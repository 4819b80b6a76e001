"""Grouped-query attention over a flat token batch and paged K/V.

Stores K and V per token: ``KVSpec(((Nkv, D), (Nkv, D)))``. Options, each from the config or the
checkpoint: q/k/v and output biases, q/k norm per head or over all heads, clipped q/k/v, RoPE on
all or the leading dims of each head, a sliding window per layer, and attention sinks (a learned
per-head logit in the softmax denominator, gpt-oss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen_data.model.attention.metadata import AttentionBatch, AttentionMetadata
from batchgen_data.model.attention.paged_decode import paged_decode_kernel
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
        self.sinks = weights.get("sinks")  # [Nq] or None
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
        out = batch.per_micro_batch(q, self.num_heads * self.head_dim,
                                    lambda q_mb, meta: self._attend(q_mb, meta, k_cache, v_cache))
        return linear(out, self.w_o, self.b_o)  # [T, H]

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [t, Nq, D] of one micro-batch -> attention output [t, Nq * D] over its paged KV."""
        decode = paged_decode_kernel(q, k_cache, meta) if self.sinks is None else None
        if decode is not None:  # one query per sequence: read the pages in place
            return decode(q, k_cache, v_cache, meta.block_table, meta.context_lens, self.scale,
                          self.sliding_window or 0)
        k_out, v_out = meta.gather_buffers.get(self.kv_spec.layout, (None, None))
        keys = meta.gather_pages(k_cache, k_out).transpose(1, 2).to(q.dtype)  # [B, Nkv, L, D]
        values = meta.gather_pages(v_cache, v_out).transpose(1, 2).to(q.dtype)
        mask = meta.mask(self.sliding_window)  # [B, 1, Q, L]
        if self.sinks is not None:
            keys, values, mask = self._with_sink(keys, values, mask)
        out = F.scaled_dot_product_attention(
            meta.pad_queries(q),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Nq, Q, D]
        return meta.unpad_outputs(out)

    def _with_sink(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
        """Attention sinks as one extra key per head: a zero key and value whose score is the
        head's sink logit (an additive mask), so it joins the softmax denominator only."""
        b, _, num_queries, _ = mask.shape
        zero = keys.new_zeros(b, self.num_kv_heads, 1, self.head_dim)
        keys, values = torch.cat((keys, zero), dim=2), torch.cat((values, zero), dim=2)  # [B, Nkv, L+1, D]
        bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~mask, float("-inf"))
        bias = bias.expand(b, self.num_heads, num_queries, mask.shape[-1])
        sink = self.sinks.to(keys.dtype).view(1, -1, 1, 1).expand(b, self.num_heads, num_queries, 1)
        return keys, values, torch.cat((bias, sink), dim=-1)  # [B, Nq, Q, L+1]
