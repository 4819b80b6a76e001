"""A decoder layer's blocks in one native call each, for decode steps with few running sequences.

At one to a few running sequences a step is bound by streaming weights and by ~65 small torch
ops per layer (RMSNorm as five, RoPE as seven per tensor, the KV write, routing's argsort,
bincount and index_add, ...), each 1-5 us: a third of the step. ``decode_layer.cpp`` runs each
residual block in one call where the layer is one whose options it implements:

- attention: grouped-query attention without biases, clipping or sinks, q/k RMSNorm per head
  or none, rotate-half RoPE over the whole head, any sliding window, fp32 KV pages;
- MoE: the ``softmax_topk`` router without a bias, SwiGLU experts without biases, no shared
  expert; resident, or streamed ones read in place from the memory-mapped checkpoint
  (``native/expert_table.py``).

Where every layer of the model is such a layer, ``fused_decode_forward`` runs all of them in one
call (``decode_forward``: the same two blocks per layer, bitwise), and ``fused_logits`` the final
norm and the LM head in another.

Every other layer, prefill, more than ``MAX_TOKENS`` tokens, and other devices or dtypes keep
the torch path. The maths is the torch path's, operation by operation; only summation orders
differ (the parity tests hold tokens to transformers').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.model.attention.gqa import GQAAttention
from batchgen_data.model.attention.metadata import AttentionBatch
from batchgen_data.model.moe.experts import SwiGLU
from batchgen_data.model.moe.native_backend import NativeExperts
from batchgen_data.model.native import active_native
from batchgen_data.model.native.expert_table import ExpertTable, stacked_table

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
    if h.shape[0] > MAX_TOKENS or h.dtype != torch.float32 or not h.is_cpu:
        return None
    table = _expert_table(layer)
    native = active_native()
    if table is None or native is None:
        return None
    router = layer.ffn.router
    return native.decode_layer.moe_block(h.contiguous(), layer.post_attention_norm, layer.eps, router.weight,
                                         router.top_k, bool(router.config.norm_topk_prob), table)


_NO_TABLE = "none"  # a layer's cached answer: its experts are not ones the kernel reads


def _expert_table(layer) -> ExpertTable | None:
    """Where the layer's routed experts sit, for the kernel (cached on its expert backend), where
    its MoE block is one the kernel implements and every expert is readable: resident (row e
    holding expert e), or a streamed store's experts read in place from the memory-mapped
    checkpoint (``StreamedExpertStore.in_place_table``); else None."""
    block = layer.ffn
    experts = getattr(block, "experts", None)  # a dense FFN has none
    if experts is None or block.shared_expert is not None:
        return None
    router = block.router
    if router.config.kind != "softmax_topk" or router.bias is not None or router.weight.dtype != torch.float32:
        return None
    if not isinstance(experts, NativeExperts) or not isinstance(experts.activation, SwiGLU):
        return None
    cached = experts.decode_table
    if cached is None:
        cached = experts.decode_table = _read_table(experts.store, experts.layer_id) or _NO_TABLE
    return None if cached is _NO_TABLE else cached


def _read_table(store, layer_id: int) -> ExpertTable | None:
    if store.capacity is not None:  # streamed: in place where the checkpoint allows, else never
        return store.in_place_table(layer_id)
    weights = store.weights(layer_id, None)
    if (weights.row_of is not None or weights.b_gate_up is not None or weights.wait_row is not None
            or weights.w_gate_up.dtype != torch.float32 or not weights.w_gate_up.is_cpu
            or not weights.w_gate_up.is_contiguous() or not weights.w_down.is_contiguous()):
        return None  # only every expert resident, row e holding expert e
    return stacked_table(weights.w_gate_up, weights.w_down)


@dataclass(slots=True)
class ForwardPlan:
    """Every layer's weights and KV pages as the address table ``decode_forward`` reads
    (``kernels.h``), for one model and KV cache; built once."""

    layer_ptrs: torch.Tensor  # [L, 10] int64
    layer_dims: torch.Tensor  # [L, 8] int64
    num_routed: int  # sum over layers of E: the counts output's length
    head_dim: int
    eps: float
    scale: float
    keep: list  # tensors the table points into that nothing else holds


def fused_decode_forward(model, h: torch.Tensor, batch: AttentionBatch, kv_cache
                         ) -> tuple[torch.Tensor, tuple[float, float], tuple[int, int]] | None:
    """All of ``model``'s layers over the decoding tokens ``h`` [T, H] in one native call
    (``decode_forward``): the step's Python work between layers (per layer two wrapper calls,
    each paying cache misses after the weights streamed through) is gone. Returns the hidden
    states, the attention and MoE seconds, and the (layer, expert) pairs that ran with the token
    rows they ran; None where a layer, the batch or the tensors are not what the kernels
    implement (the per-layer path runs)."""
    if h.shape[0] > MAX_TOKENS or h.dtype != torch.float32 or not h.is_cpu or len(batch.micro_batches) != 1:
        return None
    meta = batch.micro_batches[0]
    native = active_native()
    if meta.max_query_len != 1 or native is None:
        return None
    cached = model.fused_forward
    if cached is None or cached[0] is not kv_cache:
        cached = model.fused_forward = (kv_cache, _forward_plan(model, kv_cache))
    plan = cached[1]
    cos, sin = batch.cos_sin
    if plan is None or cos.shape[-1] != plan.head_dim:
        return None
    h = h.contiguous()
    k_cache = kv_cache.layers[0][0]
    counts = torch.empty(plan.num_routed, dtype=torch.int64)
    seconds = torch.empty(4, dtype=torch.float64)
    if not native.library.decode_forward(
            h.data_ptr(), h.shape[0], h.shape[1], plan.layer_ptrs.shape[0], plan.layer_ptrs.data_ptr(),
            plan.layer_dims.data_ptr(), plan.eps, cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
            batch.slot_mapping.data_ptr(), k_cache.shape[0], k_cache.shape[1], meta.block_table.data_ptr(),
            meta.context_lens.data_ptr(), meta.block_table.shape[1], plan.scale, counts.data_ptr(), seconds.data_ptr()):
        raise ValueError("decode_forward: a KV slot, page or block out of range, or a routed expert not held")
    attention_s, moe_s, calls, tokens = seconds.tolist()
    return h, (attention_s, moe_s), (int(calls), int(tokens))


def _forward_plan(model, kv_cache) -> ForwardPlan | None:
    """The address table over the model's layers and their KV pages (the MTP layer's, last in the
    cache, is not one of them), or None where a layer is not one the kernels implement."""
    ptrs, dims, keep = [], [], []
    head_dims, eps, scales = set(), set(), set()
    for layer, pages in zip(model.layers, kv_cache.layers):
        attention, table = layer.attention, _expert_table(layer)
        if not _plain_gqa(attention) or table is None or len(pages) != 2:
            return None
        k_cache, v_cache = pages
        if any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous()
               for t in (k_cache, v_cache, layer.input_norm, layer.post_attention_norm, layer.ffn.router.weight)):
            return None
        router = layer.ffn.router
        keep.append(table)
        ptrs.append([layer.input_norm.data_ptr(), attention.w_qkv.data_ptr(), _address(attention.q_norm),
                     _address(attention.k_norm), k_cache.data_ptr(), v_cache.data_ptr(), attention.w_o.data_ptr(),
                     layer.post_attention_norm.data_ptr(), router.weight.data_ptr(), table.addresses.data_ptr()])
        dims.append([attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.sliding_window or 0,
                     router.weight.shape[0], router.top_k, int(bool(router.config.norm_topk_prob)), table.ffn])
        head_dims.add(attention.head_dim), eps.update((attention.eps, layer.eps)), scales.add(attention.scale)
    if not ptrs or len(head_dims) != 1 or len(eps) != 1 or len(scales) != 1:
        return None
    return ForwardPlan(torch.tensor(ptrs, dtype=torch.int64), torch.tensor(dims, dtype=torch.int64),
                       sum(d[4] for d in dims), head_dims.pop(), eps.pop(), scales.pop(), keep)


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _plain_gqa(attention) -> bool:
    return (isinstance(attention, GQAAttention) and attention.b_qkv is None and attention.b_o is None
            and attention.clip_qkv is None and attention.sinks is None and attention.qk_norm in (None, "head")
            and attention.w_qkv.is_contiguous() and attention.w_o.is_contiguous())


def fused_logits(model, hidden: torch.Tensor) -> torch.Tensor | None:
    """``model.compute_logits(hidden)`` for up to ``MAX_TOKENS`` rows in one native call (the
    final RMSNorm, then the LM head through the skinny GEMM), or None where it does not apply."""
    head, norm = model.lm_head, model.norm
    if (hidden.shape[0] > MAX_TOKENS or hidden.dtype != torch.float32 or not hidden.is_cpu
            or head.dtype != torch.float32 or not head.is_contiguous() or not norm.is_contiguous()):
        return None
    native = active_native()
    if native is None:
        return None
    hidden = hidden.contiguous()
    logits = torch.empty(hidden.shape[0], head.shape[0], dtype=torch.float32)
    native.library.norm_logits(hidden.data_ptr(), logits.data_ptr(), hidden.shape[0], hidden.shape[1],
                               norm.data_ptr(), model.config.rms_norm_eps, head.data_ptr(), head.shape[0])
    return logits
