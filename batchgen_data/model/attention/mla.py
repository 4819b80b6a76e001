"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged, compressed KV cache.

Stores, per token and layer, the normalised latent and the rotated shared RoPE key:
``KVSpec(((R + Dr,),))`` — R = ``kv_lora_rank`` + Dr = ``qk_rope_head_dim`` values, instead of
the expanded 2 * Nq * D of multi-head K/V. Shapes: T tokens, Nq heads, H hidden, Dn / Dr / Dv =
no-RoPE key / RoPE key / value dims per head, Rq = ``q_lora_rank``.

NOTE: the two forms.
  * Decode (one query per sequence) runs absorbed and never expands the cache: the key
    up-projection W_uk [Nq, Dn, R] is folded into the query (q_lat = q_nope @ W_uk, [Nq, R]), so
    scores are q_lat . latent + q_pe . k_pe — one shared KV head of R + Dr dims — and the output
    stays in latent space (softmax @ latent, [Nq, R]) until the value up-projection W_uv
    [Nq, Dv, R] maps it to [Nq, Dv]. Per key it costs Nq * (2R + Dr) multiply-adds, reading only
    the compressed cache.
  * Prefill (chunks of many queries) expands the context's latents to per-head keys and values
    with kv_b_proj, as transformers does: cheaper when each key serves many queries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from batchgen_data.model.attention.metadata import AttentionBatch, AttentionMetadata
from batchgen_data.model.attention.spec import KVSpec, LayerKV
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.layers import linear, rms_norm
from batchgen_data.model.rope import RotaryEmbedding


class MLAAttention:
    """One layer's MLA. ``weights``: ``q`` (or ``q_a``, ``q_a_norm``, ``q_b``), ``kv_a``,
    ``kv_a_norm``, ``kv_b``, ``o``, and optional ``*_bias``."""

    def __init__(self, config: ModelConfig, layer_id: int, weights: dict[str, torch.Tensor]):
        mla = config.mla
        self.num_heads = config.num_attention_heads
        self.rank, self.nope_dim, self.rope_dim, self.v_dim = (
            mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)
        self.qk_dim = mla.qk_head_dim
        self.eps = config.rms_norm_eps
        self.interleave = config.rope_interleave
        self.scale = self.qk_dim**-0.5 * _yarn_softmax_mscale(config) ** 2
        # The query input (q_a or q) and kv_a read the same x: one GEMM over their stacked weights.
        q_in = weights["q_a"] if "q_a" in weights else weights["q"]
        self.w_in = torch.cat([q_in, weights["kv_a"]])  # [Rq or Nq*Dqk, H] + [R + Dr, H]
        q_bias, kv_bias = weights.get("q_a_bias"), weights.get("kv_a_bias")
        self.b_in = None
        if q_bias is not None or kv_bias is not None:
            self.b_in = torch.cat([q_bias if q_bias is not None else q_in.new_zeros(q_in.shape[0]),
                                   kv_bias if kv_bias is not None else q_in.new_zeros(weights["kv_a"].shape[0])])
        self.in_sizes = (q_in.shape[0], self.rank, self.rope_dim)
        self.q_a_norm, self.w_q_b = weights.get("q_a_norm"), weights.get("q_b")  # [Rq], [Nq*Dqk, Rq]
        self.kv_a_norm = weights["kv_a_norm"]  # [R]
        self.w_kv_b = weights["kv_b"]  # [Nq * (Dn + Dv), R]
        per_head = self.w_kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.w_uk = per_head[:, : self.nope_dim]  # [Nq, Dn, R]
        self.w_uv_t = per_head[:, self.nope_dim :].transpose(1, 2)  # [Nq, R, Dv]
        self.w_o, self.b_o = weights["o"], weights.get("o_bias")  # [H, Nq * Dv]
        self.kv_spec = KVSpec(((self.rank + self.rope_dim,),), self.w_in.dtype)

    def projection_weights(self) -> list[torch.Tensor]:
        weights = [self.w_in, self.w_kv_b, self.w_o]
        return weights if self.w_q_b is None else [*weights, self.w_q_b]

    def __call__(self, x: torch.Tensor, batch: AttentionBatch, kv: LayerKV) -> torch.Tensor:
        (cache,) = kv  # [num_blocks, block_size, R + Dr]
        num_tokens = x.shape[0]
        q_in, latent, k_pe = linear(x, self.w_in, self.b_in).split(self.in_sizes, dim=-1)
        q = q_in if self.w_q_b is None else linear(rms_norm(q_in, self.q_a_norm, self.eps), self.w_q_b)
        q = q.reshape(num_tokens, self.num_heads, self.qk_dim)  # [T, Nq, Dqk]
        cos, sin = batch.cos_sin
        q_pe = RotaryEmbedding.apply(q[..., self.nope_dim :], cos, sin, self.interleave)  # [T, Nq, Dr]
        k_pe = RotaryEmbedding.apply(k_pe.reshape(num_tokens, 1, self.rope_dim), cos, sin, self.interleave)
        latent = rms_norm(latent, self.kv_a_norm, self.eps)  # [T, R]
        cache.view(-1, cache.shape[-1])[batch.slot_mapping] = torch.cat((latent, k_pe[:, 0]), dim=-1).to(cache.dtype)
        q = torch.cat((q[..., : self.nope_dim], q_pe), dim=-1)  # [T, Nq, Dqk]
        out = batch.per_micro_batch(q, self.num_heads * self.v_dim, lambda q_mb, meta: self._attend(q_mb, meta, cache))
        return linear(out, self.w_o, self.b_o)  # [T, H]

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """q: [t, Nq, Dqk] of one micro-batch -> [t, Nq * Dv]."""
        (buffer,) = meta.gather_buffers.get(self.kv_spec.layout, (None,))
        context = meta.gather_pages(cache, buffer).to(q.dtype)  # [B, L, R + Dr]
        if meta.max_query_len == 1:
            return self._decode_absorbed(q, meta, context)
        return self._prefill_expanded(q, meta, context)

    def _decode_absorbed(self, q: torch.Tensor, meta: AttentionMetadata, context: torch.Tensor) -> torch.Tensor:
        b = q.shape[0]
        q_lat = torch.bmm(q[..., : self.nope_dim].transpose(0, 1), self.w_uk)  # [Nq, B, R]
        q_full = torch.cat((q_lat.transpose(0, 1), q[..., self.nope_dim :]), dim=-1)  # [B, Nq, R + Dr]
        # One KV head shared by every query head: the heads stand in the query axis of a
        # single-head attention, so nothing is repeated per head.
        keys = context[:, None]  # [B, 1, L, R + Dr]
        out_lat = F.scaled_dot_product_attention(
            q_full[:, None], keys, keys[..., : self.rank], attn_mask=meta.mask(None), scale=self.scale
        )  # [B, 1, Nq, R]; the [B, 1, 1, L] mask holds for every head
        out = torch.bmm(out_lat[:, 0].transpose(0, 1), self.w_uv_t)  # [Nq, B, Dv]
        return out.transpose(0, 1).reshape(b, self.num_heads * self.v_dim)

    def _prefill_expanded(self, q: torch.Tensor, meta: AttentionMetadata, context: torch.Tensor) -> torch.Tensor:
        b, num_keys = context.shape[:2]
        expanded = linear(context[..., : self.rank].reshape(b * num_keys, self.rank), self.w_kv_b)
        expanded = expanded.reshape(b, num_keys, self.num_heads, self.nope_dim + self.v_dim)
        k_pe = context[:, :, None, self.rank :].expand(b, num_keys, self.num_heads, self.rope_dim)
        keys = torch.cat((expanded[..., : self.nope_dim], k_pe), dim=-1).transpose(1, 2)  # [B, Nq, L, Dqk]
        values = expanded[..., self.nope_dim :].transpose(1, 2)  # [B, Nq, L, Dv]
        out = F.scaled_dot_product_attention(
            meta.pad_queries(q), keys, values, attn_mask=meta.mask(None), scale=self.scale
        )  # [B, Nq, Q, Dv]
        return meta.unpad_outputs(out)


def _yarn_softmax_mscale(config: ModelConfig) -> float:
    """DeepSeek's YaRN also scales the softmax by mscale(factor, mscale_all_dim)^2."""
    rope = config.rope
    if rope.rope_type == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    return 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
