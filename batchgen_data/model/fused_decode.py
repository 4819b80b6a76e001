"""A decoder layer's blocks in one native call each, for decode steps with few running sequences.

At one to a few running sequences a step is bound by streaming weights and by ~65 small torch
ops per layer (RMSNorm as five, RoPE as seven per tensor, the KV write, routing's argsort,
bincount and index_add, ...), each 1-5 us: a third of the step. ``decode_layer.cpp`` runs each
residual block in one call where the layer is one whose options it implements:

- attention: grouped-query attention without biases, clipping or sinks, q/k RMSNorm per head
  or none, rotate-half RoPE over the whole head, any sliding window, fp32 KV pages;
- MoE: the ``softmax_topk`` router without a bias, resident SwiGLU experts without biases, no
  shared expert.

Every other layer, prefill, more than ``MAX_TOKENS`` tokens, and other devices or dtypes keep
the torch path. The maths is the torch path's, operation by operation; only summation orders
differ (the parity tests hold tokens to transformers').
"""

from __future__ import annotations

import torch

from batchgen_data.model.attention.gqa import GQAAttention
from batchgen_data.model.attention.metadata import AttentionBatch
from batchgen_data.model.moe.experts import SwiGLU
from batchgen_data.model.moe.native_backend import NativeExperts
from batchgen_data.model.native import active_native

# The skinny kernel's row limit; the gain shrinks with the tokens (same-process A/B on the decode
# benchmark model: 1.26-1.37x at 1 token, 1.04-1.07x at 8, 1.03x at 16 and 32).
MAX_TOKENS = 32


def fused_attention_block(layer, h: torch.Tensor, batch: AttentionBatch, kv) -> torch.Tensor | None:
    """``layer.attention_block(h, batch, kv)`` in one native call, or None where it does not apply."""
    if h.shape[0] > MAX_TOKENS or h.dtype != torch.float32 or not h.is_cpu or len(batch.micro_batches) != 1:
        return None
    meta = batch.micro_batches[0]
    attention = layer.attention
    if meta.max_query_len != 1 or not _plain_gqa(attention):
        return None
    cos, sin = batch.cos_sin
    k_cache, v_cache = kv
    if cos.shape[-1] != attention.head_dim or k_cache.dtype != torch.float32 or not k_cache.is_contiguous():
        return None
    native = active_native()
    if native is None:
        return None
    return native.decode_layer.attention_block(
        h.contiguous(), layer.input_norm, attention.eps, attention.w_qkv, attention.num_heads, attention.num_kv_heads,
        attention.head_dim, attention.q_norm, attention.k_norm, cos.contiguous(), sin.contiguous(),
        batch.slot_mapping, k_cache, v_cache, meta.block_table, meta.context_lens, attention.w_o, attention.scale,
        attention.sliding_window or 0)


def fused_moe_block(layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``layer.ffn_block(h)`` for a MoE layer in one native call, or None where it does not apply."""
    block = layer.ffn
    if h.shape[0] > MAX_TOKENS or h.dtype != torch.float32 or not h.is_cpu or block.shared_expert is not None:
        return None
    router, experts = block.router, block.experts
    if router.config.kind != "softmax_topk" or router.bias is not None or router.weight.dtype != torch.float32:
        return None
    if not isinstance(experts, NativeExperts) or not isinstance(experts.activation, SwiGLU):
        return None
    store = experts.store
    if store.capacity is not None:
        return None
    native = active_native()
    if native is None:
        return None
    weights = store.weights(experts.layer_id, None)
    if (weights.row_of is not None or weights.b_gate_up is not None or weights.wait_row is not None
            or not weights.w_gate_up.is_contiguous() or not weights.w_down.is_contiguous()):
        return None  # only every expert resident, row e holding expert e
    return native.decode_layer.moe_block(h.contiguous(), layer.post_attention_norm, layer.eps, router.weight,
                                         router.top_k, bool(router.config.norm_topk_prob), weights.w_gate_up,
                                         weights.w_down, _identity(weights.w_gate_up.shape[0]))


def _plain_gqa(attention) -> bool:
    return (isinstance(attention, GQAAttention) and attention.b_qkv is None and attention.b_o is None
            and attention.clip_qkv is None and attention.sinks is None and attention.qk_norm in (None, "head")
            and attention.w_qkv.is_contiguous() and attention.w_o.is_contiguous())


_IDENTITY: dict[int, torch.Tensor] = {}


def _identity(n: int) -> torch.Tensor:
    if n not in _IDENTITY:
        _IDENTITY[n] = torch.arange(n, dtype=torch.int64)
    return _IDENTITY[n]
